"""`make run`: the whole stack on loopback, the demo catalog published, until Ctrl-C.

Starts redis-server (unless REDIS_URL is set) with its data under var/, then the compiler service,
publishes the demo catalog (MetaTool's 199 tools) as `metatool`, prints what was stored, and keeps
serving. Ctrl-C stops everything it started.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.config import REPO_ROOT, Settings
from shared.redis_server import LocalRedis

DEMO_CATALOG = Path(__file__).resolve().parent / "demo" / "metatool_catalog.json"


def wait_serving(addr: str, timeout: float) -> None:
    """Block until the gRPC health service at addr reports SERVING."""
    channel = grpc.insecure_channel(addr)
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{addr} did not become healthy within {timeout:.0f} s")
        time.sleep(0.2)


def start_service(module: str, env: dict, log_path: Path) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", module], env=env, stdout=log_path.open("w"),
                            stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    from shared import cli
    settings = Settings()
    with ExitStack() as stack:
        redis_url = settings.redis_url
        if not redis_url:
            redis_url = stack.enter_context(LocalRedis(REPO_ROOT / "var" / "redis")).url
            print(f"redis      {redis_url} (data in var/redis)")
        env = {**os.environ, "REDIS_URL": redis_url, "TOOLTRIE_METRICS_PORT": os.environ.get(
            "TOOLTRIE_METRICS_PORT", "0")}
        compiler = start_service("compiler_service.server", env, REPO_ROOT / "var" / "log" / "compiler.log")
        stack.callback(stop, compiler)
        wait_serving(settings.compiler_addr, 60)
        print(f"compiler   {settings.compiler_addr} (log in var/log/compiler.log)")
        cli.main(["--compiler", settings.compiler_addr, "publish", str(DEMO_CATALOG), "--name", "metatool"])
        cli.main(["--compiler", settings.compiler_addr, "versions", "metatool"])
        print("serving; try: .venv/bin/tooltrie catalogs   (Ctrl-C stops everything)")
        try:
            while compiler.poll() is None:
                time.sleep(0.5)
            print(f"the compiler exited with {compiler.returncode}: see var/log/compiler.log")
            return 1
        except KeyboardInterrupt:
            print("\nstopping")
            return 0


if __name__ == "__main__":
    sys.exit(main())

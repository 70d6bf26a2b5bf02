"""`make run`: the whole stack on loopback, the demo registry published and queried, until Ctrl-C.

Starts redis-server (unless REDIS_URL is set) with its data under var/, the compiler service,
publishes the demo registry (MetaTool's 199 tools) as the catalog `metatool`, starts the decoder (GPU
if there is one, else the CPU backend), waits while it warms the catalog prefix, sends three example
intents and prints the streamed tool names with scores and timings, then keeps serving. Ctrl-C stops
everything it started.
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

from devstack.redis_server import LocalRedis
from shared.config import REPO_ROOT, Settings
from tooltrie import cli

DEMO_REGISTRY = Path(__file__).resolve().parent / "demo" / "metatool_catalog.json"
DEMO_INTENTS = [("What's the weather going to be like in Paris this weekend?", 2),
                ("Find me a cheap flight from Berlin to Lisbon next month", 2),
                ("Summarise this PDF for me", 1)]


def wait_serving(addr: str, timeout: float, proc: subprocess.Popen, what: str = "", service: str = "") -> None:
    """Block until the gRPC health service at addr reports SERVING for service ("" : the server as a whole;
    `tooltrie.catalog.<name>`: that catalog on the decoder), showing elapsed time if `what`; fail at once
    if the service's process exits."""
    from tooltrie.client import open_channel
    channel = open_channel(addr)
    stub = health_pb2_grpc.HealthStub(channel)
    started = time.monotonic()
    deadline = started + timeout
    shown = -1
    while True:
        elapsed = int(time.monotonic() - started)
        if what and elapsed != shown:
            print(f"\r{what} ... {elapsed:4d} s", end="", flush=True)
            shown = elapsed
        try:
            if stub.Check(health_pb2.HealthCheckRequest(service=service),
                          timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                if what:
                    print(f"\r{what}: done in {time.monotonic() - started:.0f} s")
                return
        except grpc.RpcError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{addr}: the service exited with {proc.returncode} (see var/log/)")
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


def interrupt(*_):
    raise KeyboardInterrupt


def main() -> int:
    signal.signal(signal.SIGTERM, interrupt)  # stop what we started on SIGTERM too, not only Ctrl-C
    settings = Settings()
    try:
        return run(settings)
    except KeyboardInterrupt:
        print("\nstopping")
        return 0


def run(settings: Settings) -> int:
    """Start everything inside an ExitStack, so whatever was started is stopped on any exit."""
    with ExitStack() as stack:
        redis_url = settings.redis_url
        if not redis_url:
            redis_url = stack.enter_context(LocalRedis(REPO_ROOT / "var" / "redis")).url
            print(f"redis      {redis_url} (data in var/redis)")
        # reflection on for the local stack (grpcurl list); a deployment leaves it off (docs/deploy.md)
        env = {"TOOLTRIE_REFLECTION": "1", **os.environ, "REDIS_URL": redis_url}
        compiler = start_service("compiler_service.server", {**env, "TOOLTRIE_METRICS_PORT": "0"},
                                 REPO_ROOT / "var" / "log" / "compiler.log")
        stack.callback(stop, compiler)
        wait_serving(settings.compiler_addr, 60, compiler)
        print(f"compiler   {settings.compiler_addr} (log in var/log/compiler.log)")
        cli.main(["--compiler", settings.compiler_addr, "publish", str(DEMO_REGISTRY), "--name", "metatool"])
        decoder = start_service("decoder_service.server", env, REPO_ROOT / "var" / "log" / "decoder.log")
        stack.callback(stop, decoder)
        print(f"decoder    {settings.decoder_addr} (log in var/log/decoder.log, "
              f"metrics on http://127.0.0.1:{settings.metrics_port}/metrics)")
        # the demo catalog's own health, not the decoder's: another catalog left in Redis by an earlier run
        # may be ready first, and the questions below are asked of metatool
        wait_serving(settings.decoder_addr, 900, decoder,
                     "loading the models and the catalog (tool vectors, prefix)", service="tooltrie.catalog.metatool")
        for intent, k in DEMO_INTENTS:
            print(f"\n> {intent}  (k={k})")
            cli.main(["--decoder", settings.decoder_addr, "discover", intent, "-k", str(k), "--catalog", "metatool"])
        print("\nserving; try: .venv/bin/tooltrie discover \"book a hotel in Rome\" -k 2 --catalog metatool"
              "\n(Ctrl-C stops everything)")
        while compiler.poll() is None and decoder.poll() is None:
            time.sleep(0.5)
        print("a service exited: see var/log/compiler.log and var/log/decoder.log")
        return 1


if __name__ == "__main__":
    sys.exit(main())

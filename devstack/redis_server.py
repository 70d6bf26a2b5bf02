"""A real redis-server the project starts itself: on a free loopback port, data under var/.

Used by `make run` (the stack's Redis), the test suite (its own Redis for the run) and `make bench-compiler`.
Where REDIS_URL is set, `make run` and the tests start nothing and use that Redis instead.
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from shared.config import REPO_ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRedis:
    """redis-server as a child process; `with LocalRedis(...) as r: r.url`.

    With tls={"cert": ..., "key": ..., "ca": ...} it listens with TLS only (rediss://; clients are verified
    against the CA when they present a certificate); with users={"name": "password"} the default user is
    switched off and each named user may use every key and channel (an ACL user: its name and password go
    in the URL)."""

    def __init__(self, data_dir: Path | None = None, port: int | None = None, appendonly: bool = True,
                 tls: dict | None = None, users: dict[str, str] | None = None):
        self.data_dir = Path(data_dir or REPO_ROOT / "var" / "redis")
        self.port = port or free_port()
        self.appendonly = appendonly
        self.tls, self.users = tls, users or {}
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        scheme = "rediss" if self.tls else "redis"
        auth = ""
        if self.users:
            user, password = next(iter(self.users.items()))
            auth = f"{user}:{password}@"
        return f"{scheme}://{auth}127.0.0.1:{self.port}/0"

    def _args(self) -> list[str]:
        args = ["--port", str(self.port)]
        if self.tls:
            args = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls["cert"]),
                    "--tls-key-file", str(self.tls["key"]), "--tls-ca-cert-file", str(self.tls["ca"]),
                    "--tls-auth-clients", "optional"]
        for user, password in self.users.items():
            args += ["--user", user, "on", f">{password}", "~*", "&*", "+@all"]
        if self.users:
            args += ["--user", "default", "off"]
        return args

    def client(self) -> redis.Redis:
        from shared.store import redis_client
        return redis_client(self.url, ca_file=str(self.tls["ca"]) if self.tls else "")

    def start(self, timeout: float = 10.0) -> "LocalRedis":
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is missing: run 'sudo apt-get install redis-server' (or set REDIS_URL)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [exe, *self._args(), "--bind", "127.0.0.1", "--dir", str(self.data_dir),
             "--appendonly", "yes" if self.appendonly else "no", "--save", "", "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        client = self.client()
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)
            finally:
                client.close()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None

    def __enter__(self) -> "LocalRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

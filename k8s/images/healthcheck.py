"""Container HEALTHCHECK: exit 0 when the service's standard gRPC health service says SERVING.

Kubernetes ignores a Dockerfile HEALTHCHECK (the pod's gRPC probes do that job there); this is
for `docker run` and compose, where it is the only signal. It asks the overall server status
(service ""), which both services report, on the port of the address they listen on.

    python healthcheck.py TOOLTRIE_DECODER_ADDR
"""
from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEFAULTS = {"TOOLTRIE_COMPILER_ADDR": "0.0.0.0:50051", "TOOLTRIE_DECODER_ADDR": "0.0.0.0:50052"}
WILDCARD_HOSTS = {"", "0.0.0.0", "[::]", "::"}


def local_target(address: str) -> str:
    """Where to dial a server listening on `address` from inside its own container."""
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"not host:port: {address!r}")
    return f"{'127.0.0.1' if host in WILDCARD_HOSTS else host}:{port}"


def check(target: str, timeout: float = 3.0) -> bool:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError as exc:
            print(f"{target}: {exc.code().name}", file=sys.stderr)
            return False
    print(f"{target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in DEFAULTS:
        print(f"usage: healthcheck.py {{{'|'.join(DEFAULTS)}}}", file=sys.stderr)
        return 2
    name = argv[0]
    return 0 if check(local_target(os.environ.get(name, DEFAULTS[name]))) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

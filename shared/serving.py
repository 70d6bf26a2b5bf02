"""What both gRPC services share: error-to-status mapping, health, reflection, metrics, shutdown."""
from __future__ import annotations

import functools
import json
import logging
import signal
import threading
from concurrent import futures

import grpc
import redis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import Counter, start_http_server

from shared.catalog import CatalogError
from shared.store import NotFound
from shared.tokenizer import TokenizerError

log = logging.getLogger("tooltrie")

RPC_TOTAL = Counter("tooltrie_rpc_total", "RPCs handled, by service, method and status code",
                    ["service", "method", "code"])

# Exception type -> gRPC status code; the exception's message becomes the status details.
ERROR_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (CatalogError, grpc.StatusCode.INVALID_ARGUMENT),
    (TokenizerError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (redis.ConnectionError, grpc.StatusCode.UNAVAILABLE),
    (redis.TimeoutError, grpc.StatusCode.UNAVAILABLE),
]


def status_for(exc: BaseException,
               extra: list[tuple[type[BaseException], grpc.StatusCode]] = ()) -> grpc.StatusCode:
    """The status an exception leaves as: a service's own mapping first, then the shared one,
    INTERNAL for anything unexpected."""
    for kind, code in [*extra, *ERROR_CODES]:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def rpc(service: str):
    """Decorator for a unary servicer method: counts it and turns known exceptions into statuses."""
    def wrap(method):
        @functools.wraps(method)
        def handler(self, request, context):
            try:
                response = method(self, request, context)
                RPC_TOTAL.labels(service, method.__name__, "OK").inc()
                return response
            except Exception as exc:  # noqa: BLE001 - every failure must leave as a status
                code = status_for(exc)
                if code == grpc.StatusCode.INTERNAL:
                    log.exception("%s.%s failed", service, method.__name__)
                if code == grpc.StatusCode.UNAVAILABLE:
                    detail = f"redis unavailable: {exc}"
                else:
                    detail = str(exc)
                RPC_TOTAL.labels(service, method.__name__, code.name).inc()
                context.abort(code, detail)
        return handler
    return wrap


def make_server(address: str, add_servicers, service_names: list[str], max_workers: int = 16,
                options: list[tuple[str, int]] = ()):
    """A gRPC server with health (NOT_SERVING until set_serving) and reflection; returns (server, health)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         options=[("grpc.max_receive_message_length", 64 << 20),
                                  ("grpc.max_send_message_length", 64 << 20), *options])
    add_servicers(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    if server.add_insecure_port(address) == 0:
        raise RuntimeError(f"cannot listen on {address}")
    for name in ["", *service_names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    return server, health_servicer


def set_serving(health_servicer, service_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        health_servicer.set(name, status)


def start_metrics(port: int) -> None:
    if port:
        start_http_server(port, addr="0.0.0.0")
        log.info("metrics on :%d/metrics", port)


def wait_for_termination(server, health_servicer, service_names: list[str], grace: float,
                         before_stop=None) -> None:
    """Block until SIGTERM/SIGINT, then report NOT_SERVING, let in-flight RPCs finish, and stop."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("draining for up to %.0f s", grace)
    set_serving(health_servicer, service_names, False)
    if before_stop:
        before_stop()
    server.stop(grace).wait()
    log.info("stopped")


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line; a `request_id` passed in `extra` is kept as its own field."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": self.formatTime(record), "level": record.levelname, "logger": record.name,
                 "msg": record.getMessage()}
        if hasattr(record, "request_id"):
            entry["request_id"] = record.request_id
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging() -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLogFormatter())
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)

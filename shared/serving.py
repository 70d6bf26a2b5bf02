"""What both gRPC services share: error-to-status mapping, health, reflection, metrics, shutdown, and
the guard every call passes first (undecodable requests, bounded fields, authorization), TLS."""
from __future__ import annotations

import functools
import hmac
import json
import logging
import os
import signal
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc
import redis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import Counter, start_http_server

from shared.catalog import CatalogError, clip
from shared.store import LatestMoved, NotFound
from shared.tokenizer import TokenizerError

log = logging.getLogger("tooltrie")

# After SIGTERM the server keeps taking calls this long before it stops taking any (the decoder refuses them:
# UNAVAILABLE, which clients retry): a call already on the wire reaches a handler instead of being cancelled.
REFUSE_SECONDS = 0.5
DRAIN_MARGIN = 0.5    # seconds before the drain ends at which a service fails what is left itself (at_drain_end)
EXIT_SLACK = 4.5      # seconds past the drain by which the process has exited, always (the watchdog)
RPC_TOTAL = Counter("tooltrie_rpc_total", "RPCs handled, by service, method and status code",
                    ["service", "method", "code"])

class AddressInUse(RuntimeError):
    """A server's address cannot be bound: another process listens there (ports are never shared)."""


class Busy(Exception):
    """The service is at its bound for this kind of work; the caller should back off (RESOURCE_EXHAUSTED)."""


# Exception type -> gRPC status code; the exception's message becomes the status details.
ERROR_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (Busy, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (CatalogError, grpc.StatusCode.INVALID_ARGUMENT),
    (TokenizerError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (LatestMoved, grpc.StatusCode.ABORTED),
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


def client_message(exc: BaseException) -> str:
    """What a caller is told of an error: its message, clipped; for Redis only that it is unavailable (its
    address and the driver's words stay in the service's log)."""
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
        log.warning("redis unavailable: %s", exc)
        return "redis is unavailable; retry shortly"
    return clip(str(exc), 1000)


def rpc(service: str):
    """Decorator for a unary servicer method: counts it and turns known exceptions into statuses."""
    def wrap(method):
        @functools.wraps(method)
        def handler(self, request, context):
            try:
                response = method(self, request, context)
                RPC_TOTAL.labels(service, method.__name__, "OK").inc()
                return response
            except Exception as exc:  # every failure must leave as a status
                code = status_for(exc)
                if code == grpc.StatusCode.INTERNAL:
                    log.exception("%s.%s failed", service, method.__name__)
                RPC_TOTAL.labels(service, method.__name__, code.name).inc()
                context.abort(code, client_message(exc))
        return handler
    return wrap


def server_credentials(settings) -> grpc.ServerCredentials | None:
    """TLS credentials from the settings (TOOLTRIE_TLS_CERT/KEY; with TOOLTRIE_TLS_CLIENT_CA, clients
    must present a certificate it signed), or None for plaintext."""
    if not settings.tls_cert and not settings.tls_key:
        return None
    if not (settings.tls_cert and settings.tls_key):
        raise SystemExit("TLS needs both TOOLTRIE_TLS_CERT and TOOLTRIE_TLS_KEY")
    client_ca = Path(settings.tls_client_ca).read_bytes() if settings.tls_client_ca else None
    return grpc.ssl_server_credentials([(Path(settings.tls_key).read_bytes(), Path(settings.tls_cert).read_bytes())],
                                       root_certificates=client_ca, require_client_auth=client_ca is not None)


def make_server(address: str, add_servicers, service_names: list[str], max_workers: int = 16,
                options: list[tuple[str, int]] = (), credentials: grpc.ServerCredentials | None = None,
                reflection_on: bool = True, interceptors: list = ()):
    """A gRPC server with health (NOT_SERVING until set_serving) and, when asked, reflection; TLS when
    given credentials; every call through the interceptors (a Guard); returns (server, health)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         interceptors=list(interceptors) or [Guard({})],
                         options=[("grpc.max_receive_message_length", 64 << 20),
                                  ("grpc.max_send_message_length", 64 << 20),
                                  ("grpc.so_reuseport", 0), *options])   # a port in use is an error, never shared
    add_servicers(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if reflection_on:
        reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    try:
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port == 0:
        raise AddressInUse(f"cannot listen on {address}: the address is in use (another server on this machine?) "
                           "or not this machine's")
    for name in ["", *service_names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    return server, health_servicer


def set_serving(health_servicer, service_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        health_servicer.set(name, status)


def follow_redis(ping: Callable[[], object], health_servicer, service_names: list[str], stop: threading.Event,
                 interval: float = 1.0) -> None:
    """Keep the health status in step with Redis: SERVING while ping() succeeds, NOT_SERVING while it
    fails (every call would answer UNAVAILABLE), until stop is set."""
    serving = None
    while not stop.is_set():
        try:
            ping()
            ok = True
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            ok = False
        if ok != serving and not stop.is_set():
            set_serving(health_servicer, service_names, ok)
            if serving is not None or not ok:
                log.log(logging.INFO if ok else logging.WARNING, "redis %s: %s", "reachable" if ok else "unreachable",
                        "SERVING" if ok else "NOT_SERVING")
            serving = ok
        stop.wait(interval)


def start_metrics(port: int, host: str = "127.0.0.1") -> None:
    if port:
        start_http_server(port, addr=host)
        log.info("metrics on %s:%d/metrics", host, port)


# --- the guard: undecodable requests, bounded fields, authorization ------------------------------

class Undecodable:
    """What a request that does not parse as its message becomes (answered INVALID_ARGUMENT)."""

    def __init__(self, error: Exception):
        self.error = error


def _lenient(deserialize):
    def parse(data: bytes):
        try:
            return deserialize(data)
        except Exception as e:  # noqa: BLE001 - any parse failure is the caller's bad input
            return Undecodable(e)
    return parse


class Credentials:
    """Who may make a protected call: a bearer token (any of tokens, compared in constant time) in the
    `authorization` metadata, or a client certificate (mutual TLS) whose CN or SAN is in identities."""

    def __init__(self, tokens: list[str] = (), identities: list[str] = ()):
        self.tokens = [t.encode() for t in tokens if t]
        self.identities = {i for i in identities if i}

    @property
    def required(self) -> bool:
        return bool(self.tokens or self.identities)

    def check(self, context) -> str | None:
        """None when the caller is allowed, else why not."""
        presented = b""
        headers = [value for key, value in context.invocation_metadata() or () if key == "authorization"]
        if len(headers) > 1:
            return "more than one authorization header"
        for value in headers:
            value = value.decode("latin-1") if isinstance(value, bytes) else value
            if value[:7].lower() == "bearer ":
                presented = value[7:].strip().encode("utf-8", "replace")
        ok = False
        for token in self.tokens:   # every token compared, in constant time each
            ok |= hmac.compare_digest(presented, token)
        if ok:
            return None
        if self.identities:
            auth = context.auth_context() or {}
            names = {v.decode("utf-8", "replace") if isinstance(v, bytes) else v
                     for k in ("x509_common_name", "x509_subject_alternative_name") for v in auth.get(k, ())}
            if names & self.identities:
                return None
        return "missing or invalid bearer token" if presented or not self.identities else \
            "this call needs a bearer token (authorization: Bearer ...) or an allowed client certificate"


@dataclass
class Rule:
    """What the guard checks for one method before its handler runs: the request's bounds (validate
    raises CatalogError/ValueError -> INVALID_ARGUMENT) and, when protected(request) says so, the
    caller's credentials (UNAUTHENTICATED)."""
    validate: Callable | None = None
    credentials: Credentials | None = None
    protected: Callable = field(default=lambda request: True)


class Guard(grpc.ServerInterceptor):
    """Runs before every handler: a request that cannot be decoded is INVALID_ARGUMENT (gRPC's own
    answer is INTERNAL), then the method's Rule. Rejections are counted in tooltrie_rpc_total."""

    def __init__(self, rules: dict[str, Rule]):
        self.rules = rules

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or handler.request_streaming:
            return handler
        rule = self.rules.get(details.method)
        service, _, method = details.method.lstrip("/").rpartition("/")

        def admit(request, context) -> None:
            code = message = None
            if isinstance(request, Undecodable):
                code, message = grpc.StatusCode.INVALID_ARGUMENT, \
                    f"the request is not a valid {method} message: {clip(str(request.error), 200)}"
            elif rule is not None:
                if rule.credentials is not None and rule.credentials.required and rule.protected(request):
                    why = rule.credentials.check(context)
                    if why:
                        code, message = grpc.StatusCode.UNAUTHENTICATED, f"{method}: {why}"
                if code is None and rule.validate is not None:
                    try:
                        rule.validate(request)
                    except (CatalogError, ValueError) as e:
                        code, message = grpc.StatusCode.INVALID_ARGUMENT, clip(str(e), 1000)
            if code is not None:
                RPC_TOTAL.labels(service, method, code.name).inc()
                context.abort(code, message)

        deserialize = _lenient(handler.request_deserializer) if handler.request_deserializer else None
        if handler.unary_unary:
            inner = handler.unary_unary

            def unary(request, context):
                admit(request, context)
                return inner(request, context)
            return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=deserialize,
                                                       response_serializer=handler.response_serializer)
        inner_stream = handler.unary_stream

        def stream(request, context):
            admit(request, context)
            yield from inner_stream(request, context)
        return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=deserialize,
                                                    response_serializer=handler.response_serializer)


def wait_for_termination(server, health_servicer, service_names: list[str], grace: float,
                         before_stop=None, at_drain_end=None) -> None:
    """Block until SIGTERM/SIGINT, then report NOT_SERVING, refuse new calls for REFUSE_SECONDS, let in-flight
    RPCs finish for up to `grace` seconds, call at_drain_end (the decoder fails what is left with UNAVAILABLE,
    a moment before gRPC would cancel it), and stop. The process ends within grace + EXIT_SLACK seconds of the
    signal whatever its threads do: a watchdog exits it past that."""
    # The handler only sets a flag: one that takes a lock (Event.set) deadlocks when the signal lands while the
    # main thread holds that lock inside Event.wait, and the process never drains.
    stopped = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.append(True))
    while not stopped:
        time.sleep(0.1)
    signalled = time.monotonic()
    threading.Thread(target=_exit_after, args=(grace + EXIT_SLACK,), daemon=True,
                     name="tooltrie-exit-watchdog").start()
    log.info("draining for up to %.0f s", grace)
    if before_stop:
        before_stop()
    set_serving(health_servicer, service_names, False)
    time.sleep(min(REFUSE_SECONDS, grace))
    done = server.stop(max(grace - REFUSE_SECONDS, 0.0))
    done.wait(max(signalled + grace - DRAIN_MARGIN - time.monotonic(), 0.0))
    if at_drain_end:
        at_drain_end()
    done.wait(EXIT_SLACK / 2)
    log.info("stopped")


def _exit_after(seconds: float) -> None:
    """The last resort of a shutdown: end the process `seconds` after the signal, whatever still runs."""
    time.sleep(seconds)
    alive = [t.name for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon]
    log.error("still running %.0f s after the signal (threads: %s): exiting now", seconds, ", ".join(alive)[:500])
    logging.shutdown()
    os._exit(1)


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

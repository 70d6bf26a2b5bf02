"""The decoder service: streaming Discover and GetInfo over gRPC, catalogs followed from Redis.

`python -m decoder_service.server` loads the model (GPU when there is one, else the CPU backend),
loads and warms the latest version of each published catalog, reports SERVING on the standard
health service, and serves until SIGTERM, which drains in-flight requests first.
"""
from __future__ import annotations

import contextlib
from concurrent.futures import Future
import logging
import threading
import time
import uuid
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2
from prometheus_client import Counter, Gauge, Histogram

from decoder_service.catalogs import CatalogLoading, CatalogManager, CatalogRefused
from decoder_service.confidence import Calibrator
from decoder_service.engine.fusion import RETRIEVAL_ORDER
from decoder_service.engine.engine import DecodeEngine, EngineConfig, Expired, QueueFull, RequestError, Stopped
from decoder_service.engine.sequence import DoneEvent, FailedEvent, PointerEvent
from decoder_service.reader import Reader, reads
from shared.catalog import check_catalog_name, shown
from shared.config import Settings
from shared.rpc import decoder_pb2 as pb, decoder_pb2_grpc as pb_grpc
from shared.serving import (DRAIN_MARGIN, RPC_TOTAL, AddressInUse, Credentials, Guard, Rule, client_message,
                            make_server, server_credentials, set_serving, setup_logging, start_metrics, status_for,
                            wait_for_termination)
from shared.store import CatalogStore

log = logging.getLogger("tooltrie.decoder")
SERVICE = pb.DESCRIPTOR.services_by_name["DecoderService"].full_name
QUEUE_DEPTH = Gauge("tooltrie_decoder_queue_depth", "Discover requests waiting for admission")
RUNNING = Gauge("tooltrie_decoder_running_batch", "Sequences in the running batch")
KV_USED = Gauge("tooltrie_decoder_kv_blocks_used", "KV pool blocks in use")
KV_CONSISTENT = Gauge("tooltrie_decoder_kv_pool_consistent", "1 while every KV block is free once or held (0: an "
                      "engine fault; see the log)")
STEPS_AHEAD = Gauge("tooltrie_decoder_steps_ahead", "Steps launched before the previous step's picks were read, "
                    "since start")
STEPS_DROPPED = Gauge("tooltrie_decoder_steps_dropped", "Steps launched ahead of rows that all ended at the "
                      "read before, dropped unread, since start")
TOKENS_FORCED = Gauge("tooltrie_decoder_tokens_forced", "Answer tokens taken without a step of their own (each the "
                      "only candidate its request leaves), since start")
FIRST_POINTER = Histogram("tooltrie_time_to_first_pointer_seconds", "From request to its first tool name")
STEP_SECONDS = Histogram("tooltrie_decode_step_seconds", "One engine step (forward pass and sampler)")
REQUESTS = Counter("tooltrie_discover_total", "Discover requests by outcome code", ["code"])

# Engine and catalog exceptions -> status codes (the shared ones come from shared.serving.status_for).
REFUSALS = [(RequestError, grpc.StatusCode.INVALID_ARGUMENT), (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
            (Expired, grpc.StatusCode.DEADLINE_EXCEEDED),
            (CatalogRefused, grpc.StatusCode.FAILED_PRECONDITION), (TimeoutError, grpc.StatusCode.UNAVAILABLE),
            (Stopped, grpc.StatusCode.UNAVAILABLE), (CatalogLoading, grpc.StatusCode.UNAVAILABLE)]
FAILED_CODES = {"internal": grpc.StatusCode.INTERNAL, "deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
                "cancelled": grpc.StatusCode.CANCELLED, "unavailable": grpc.StatusCode.UNAVAILABLE,
                "busy": grpc.StatusCode.RESOURCE_EXHAUSTED}


def retrieved(rt, shortlist, k: int, prefill_ms: float = 0.0):
    """The events of an answer taken in the shortlist's order (retrieval's, or the reader's): its first k tools,
    then Done."""
    for i, pid in enumerate(shortlist.ids[:k]):
        pid = int(pid)
        yield PointerEvent(index=i, pointer_id=pid, name=rt.trie.pointer_names[pid],
                           token_ids=tuple(rt.spelled[pid]), logprob=0.0)
    yield DoneEvent(prompt_tokens=0, generated_tokens=0, queue_ms=0.0, prefill_ms=prefill_ms, decode_ms=0.0)


class DecoderServicer(pb_grpc.DecoderServiceServicer):
    def __init__(self, engine: DecodeEngine, catalogs: CatalogManager, info: dict,
                 reader: Lazy | None = None):
        self.engine, self.catalogs, self.info, self.reader = engine, catalogs, info, reader
        self.calibrator = Calibrator.load()
        self.draining = False
        self._live_ids: set[str] = set()   # the request ids of the Discover calls in flight
        self._ids_lock = threading.Lock()

    @contextlib.contextmanager
    def _claim(self, request_id: str, context):
        """Hold a request id for the call's life: a caller's id is unique among the calls in flight (a
        second call with it, such as a retry while the first still runs, is ALREADY_EXISTS)."""
        with self._ids_lock:
            taken = request_id in self._live_ids
            self._live_ids.add(request_id)
        if taken:
            self._abort(context, grpc.StatusCode.ALREADY_EXISTS,
                        f"request_id {request_id!r} is already in flight on this decoder")
        try:
            yield
        finally:
            with self._ids_lock:
                self._live_ids.discard(request_id)

    def _abort(self, context, code: grpc.StatusCode, message: str):
        if code == grpc.StatusCode.INTERNAL:
            log.error("Discover failed: %s", message)
        REQUESTS.labels(code.name).inc()
        RPC_TOTAL.labels(SERVICE, "Discover", code.name).inc()
        context.abort(code, message)

    def Discover(self, request, context):
        if self.draining:
            self._abort(context, grpc.StatusCode.UNAVAILABLE, "the decoder is shutting down")
        request_id = request.request_id or uuid.uuid4().hex
        with self._claim(request_id, context):
            yield from self._discover(request, request_id, context)

    def _discover(self, request, request_id: str, context):
        """Discover's stream: pin a version, retrieve, decode or read where the request's mode says so, stream the
        pointers. MODE_AUTO decodes where the generator's selector can change the answer (below the version's
        RETRIEVAL_ORDER weight); on a catalog it was not tuned on the reader reranks the shortlist where there is
        one and the catalog's tools mostly lack examples (reader.reads); with no more than k tools to choose from,
        it answers at retrieval's cost."""
        started = time.monotonic()
        try:
            rt = self.catalogs.acquire(request.catalog, request.version)
        except Exception as e:  # noqa: BLE001 - mapped to a status
            self._abort(context, status_for(e, REFUSALS), client_message(e))
        seq = read = None  # once submitted, the engine releases the catalog pin when it lets go of the request
        try:
            try:
                auto = request.mode == pb.MODE_AUTO
                decode = request.mode == pb.MODE_DECODE or auto and rt.fusion_weight < RETRIEVAL_ORDER
                shortlist = self.engine.retrieve(rt, request.intent, request.k, list(request.allow) or None,
                                                 request.shortlist, prompt=decode)
                choice = request.k < len(shortlist.ids)   # otherwise the generator would choose them all
                decode = decode and (choice or not auto)
                if auto and not decode and choice and self.reader is not None and reads(rt):
                    read = self.reader.get().read(rt.trie, request.intent, shortlist, request.k)
                if decode:
                    seq = self.engine.submit(rt, request.intent, request.k, request_id=request_id,
                                             timeout=context.time_remaining(), shortlist=shortlist,
                                             on_finish=lambda: self.catalogs.release(rt))
            except (RequestError, QueueFull, Expired, Stopped) as e:
                self._abort(context, status_for(e, REFUSALS), client_message(e))
            if seq is not None and not context.add_callback(lambda: self.engine.cancel(seq)):
                self.engine.cancel(seq)  # the RPC ended before the callback could be added
            name, version = rt.key
            log.info("discover %s v%d k=%d", name, version, request.k, extra={"request_id": request_id})
            yield pb.DiscoverEvent(accepted=pb.Accepted(catalog=name, version=version, request_id=request_id))
            rank = {int(p): (r, float(shortlist.scores[r])) for r, p in enumerate(shortlist.ids)}
            events = seq if seq is not None else retrieved(rt, read or shortlist, request.k,
                                                           read.seconds * 1e3 if read else 0.0)
            stage = "generator" if decode else "reader" if read else "retrieval"
            confidence, cut = 1.0, 0   # each pointer's, capped by the one before: a cut is the answer's tail
            for event in events:
                if isinstance(event, FailedEvent):
                    self._abort(context, FAILED_CODES.get(event.kind, grpc.StatusCode.INTERNAL), event.message)
                if isinstance(event, DoneEvent):
                    REQUESTS.labels("OK").inc()
                    RPC_TOTAL.labels(SERVICE, "Discover", "OK").inc()
                    yield pb.DiscoverEvent(done=pb.Done(**event.__dict__, retrieval_ms=shortlist.seconds * 1e3,
                                                        stage=stage, cut=cut))
                    return
                if event.index == 0:
                    FIRST_POINTER.observe(time.monotonic() - started)
                r, score = rank[event.pointer_id]
                # the reader has no fitted model of its own: its pointers are calibrated by their retrieval scores
                confidence = self.calibrator.confidence("retrieval" if read else stage, shortlist.scores, request.k,
                                                        r, event.logprob, confidence)
                if confidence < request.min_confidence:
                    cut += 1
                    continue
                yield pb.DiscoverEvent(pointer=pb.Pointer(index=event.index, name=event.name,
                                                          token_ids=list(event.token_ids), logprob=event.logprob,
                                                          retrieval_score=score, retrieval_rank=r,
                                                          confidence=confidence,
                                                          **(rt.trie.definition(event.pointer_id)
                                                             if request.include_definitions else {})))
        finally:
            if seq is None:
                self.catalogs.release(rt)

    def GetInfo(self, request, context):
        e = self.engine
        return pb.GetInfoResponse(
            **self.info, kv_capacity_tokens=e.blocks.num_blocks * e.block_size, kv_block_size=e.block_size,
            kv_free_blocks=e.blocks.num_free, max_sequences=e.config.max_seqs,
            catalogs=[pb.LoadedCatalog(name=c["name"], version=c["version"], latest=c["latest"], ready=c["ready"],
                                       tools=c["tools"], prefix_tokens=c["prefix_tokens"],
                                       active_requests=c["active_requests"]) for c in self.catalogs.describe()])


def in_background(what: str, make) -> Future:
    """make() on a thread of its own, as a Future: a part that loads while another does."""
    future: Future = Future()

    def run():
        try:
            future.set_result(make())
        except BaseException as e:
            log.exception("the %s did not load", what)
            future.set_exception(e)
    threading.Thread(target=run, name=f"{what}-load", daemon=True).start()
    return future


class Lazy:
    """A part built on its first use, once: the reader, which only a catalog the selector was not tuned on needs
    (a decoder that never serves one never loads it, and no start waits for it)."""

    def __init__(self, what: str, make):
        self.what, self.make, self.value, self.lock = what, make, None, threading.Lock()

    def get(self):
        with self.lock:
            if self.value is None:
                started = time.monotonic()
                self.value = self.make()
                log.info("%s loaded in %.2f s", self.what, time.monotonic() - started)
            return self.value


def build_engine(settings: Settings):
    """Model, backend, KV pool, engine, the retriever's encoder and the reader from the settings; returns (engine,
    encoder or None, the reader (Lazy) or None, info for GetInfo)."""
    from decoder_service.encoder import load_encoder
    from decoder_service.engine.fusion import tuned_tools
    from decoder_service.gpu.device import resolve_backend
    from decoder_service.model.backend import device_name, make_backend, weights_dtype
    from decoder_service.model.config import ModelConfig
    from decoder_service.model.kv_pool import KVPoolSpec
    from decoder_service.model.weights import load_weights
    from shared.tokenizer import ModelTokenizer
    cfg = ModelConfig.from_dir(settings.model_dir)
    kv_spec = KVPoolSpec.from_tokens(settings.kv_tokens)
    kind = resolve_backend(settings.backend)
    max_seqs = settings.max_seqs or MAX_SEQS[kind]

    def loaded_encoder():
        encoder = load_encoder(settings.encoder_dir, kind)
        encoder.encode(["warm"])   # its first pass loads its compiled kernels
        return encoder
    # on the CPU the encoder loads and warms while the generator's weights load (numpy lets go of the GIL: on 2 cores
    # the decoder listens about 0.5 s sooner)
    encoding = in_background("encoder", loaded_encoder) if settings.encoder_dir and kind == "cpu" else None
    weights = load_weights(settings.model_dir, cfg, weights_dtype(kind, cfg))
    # The GPU backend's step buffers: a logit row per sequence, a block-table row per sequence.
    backend = make_backend(cfg, weights, kv_spec, backend=kind, max_logit_rows=max_seqs,
                           max_table=max_seqs * -(-cfg.max_position_embeddings // kv_spec.block_size))
    engine = DecodeEngine(backend, ModelTokenizer(settings.model_dir), num_blocks=kv_spec.num_blocks,
                          block_size=kv_spec.block_size, max_positions=cfg.max_position_embeddings,
                          config=EngineConfig(max_seqs=max_seqs, max_waiting=settings.max_waiting,
                                              shortlist=settings.shortlist, fusion_weight=settings.fusion_weight,
                                              fusion_weight_unseen=settings.fusion_weight_unseen,
                                              line_kv=settings.line_kv),
                          tuned_tools=tuned_tools(settings.model_dir))
    encoder = encoding.result() if encoding else loaded_encoder() if settings.encoder_dir else None
    reader = None
    if settings.reader_dir:
        ModelConfig.from_dir(Path(settings.reader_dir))   # a wrong folder fails the start, not a request
        reader = Lazy(f"the reader {Path(settings.reader_dir).name}", lambda: Reader(Path(settings.reader_dir), kind))
    info = {"model": str(settings.model_dir.name), "backend": kind, "device": device_name(kind),
            "encoder": encoder.name if encoder else ""}
    return engine, encoder, reader, info


def watch_metrics(engine: DecodeEngine, stop: threading.Event) -> None:
    while not stop.wait(0.5):
        QUEUE_DEPTH.set(engine.queue_depth())
        RUNNING.set(len(engine.scheduler.running))
        KV_USED.set(engine.blocks.num_blocks - engine.blocks.num_free)
        KV_CONSISTENT.set(int(engine.blocks.consistent()))
        STEPS_AHEAD.set(engine.steps_ahead)
        STEPS_DROPPED.set(engine.steps_dropped)
        TOKENS_FORCED.set(engine.tokens_forced)


MAX_SEQS = {"cuda": 64, "cpu": 2}   # TOOLTRIE_MAX_SEQS=0: sequences decoded at once, measured per backend (A1)
MAX_REQUEST_ID_CHARS = 128
MAX_ALLOW = 10_000
HEALTH_PREFIX = "tooltrie.catalog."   # per-catalog health service names: tooltrie.catalog.<name>


def check_discover(settings: Settings):
    """Discover's bounds, checked before the request touches a catalog (every field of the request is
    bounded; a message never echoes more than a clipped piece of the input)."""
    max_name = settings.max_name_chars

    def validate(request) -> None:
        check_catalog_name(request.catalog)
        if len(request.request_id) > MAX_REQUEST_ID_CHARS or not request.request_id.isprintable():
            raise ValueError(f"request_id must be at most {MAX_REQUEST_ID_CHARS} printable characters "
                             f"(got {len(request.request_id)})")
        if len(request.allow) > MAX_ALLOW:
            raise ValueError(f"the allowlist names {len(request.allow)} tools, over the limit of {MAX_ALLOW}")
        long = next((a for a in request.allow if len(a) > max_name), None)
        if long is not None:
            raise ValueError(f"allowlist entry {shown(long)} has {len(long)} characters, over the limit of {max_name}")
        if request.version < 0:
            raise ValueError(f"version must be 0 (the latest) or a version number, got {request.version}")
        if request.mode not in pb.Mode.values():
            raise ValueError(f"mode must be one of {', '.join(pb.Mode.keys())}, got {request.mode}")
        if not 0.0 <= request.min_confidence <= 1.0:   # NaN fails this too
            raise ValueError(f"min_confidence must be from 0 to 1, got {request.min_confidence:g}")
    return validate


def guard(settings: Settings) -> Guard:
    """Discover's bounds; Discover and GetInfo need TOOLTRIE_DISCOVER_TOKEN when it is set."""
    creds = Credentials([settings.discover_token])
    return Guard({f"/{SERVICE}/Discover": Rule(check_discover(settings), creds),
                  f"/{SERVICE}/GetInfo": Rule(None, creds)})


def server_options(settings: Settings) -> list[tuple[str, int]]:
    """Connections are recycled every TOOLTRIE_MAX_CONNECTION_AGE_S (so clients balancing round-robin over a
    headless Service re-resolve and find new replicas); a stream already accepted is never cut by it (an
    unbounded grace: the GOAWAY only stops new streams on the old connection). SIGTERM's drain is what
    bounds a shutdown."""
    if settings.max_connection_age_s <= 0:
        return []
    return [("grpc.max_connection_age_ms", int(settings.max_connection_age_s * 1000)),
            ("grpc.max_connection_age_grace_ms", 2**31 - 1)]


def follow_health(catalogs: CatalogManager, health, stop: threading.Event, interval: float = 0.2) -> None:
    """Publish readiness until stop: per catalog under `tooltrie.catalog.<name>` (SERVING while it has a ready
    default version), and overall ("" and the service's name) by CatalogManager.ready's policy: the first
    pass over the store is done and at least one catalog is served. A refused or corrupt catalog is
    NOT_SERVING under its own name and holds nothing else back."""
    shown_status: dict[str, bool] = {}
    serving = None
    while not stop.is_set():
        try:
            for name, ok in catalogs.catalog_health().items():
                if shown_status.get(name) != ok:
                    health.set(HEALTH_PREFIX + name, health_pb2.HealthCheckResponse.SERVING if ok
                               else health_pb2.HealthCheckResponse.NOT_SERVING)
                    shown_status[name] = ok
            ready = catalogs.ready()
            if ready != serving and not stop.is_set():
                set_serving(health, [SERVICE], ready)
                if ready:
                    log.info("serving: %s", ", ".join(f"{c['name']} v{c['version']}" for c in catalogs.describe()))
                serving = ready
        except Exception:  # health must keep following whatever one pass meets
            log.exception("health follower: a pass failed; the next one retries")
        stop.wait(interval)


def serve(settings: Settings | None = None) -> None:
    settings = settings or Settings()
    if not settings.redis_url:
        raise SystemExit("REDIS_URL is not set: point it at a Redis (`make run` starts one for you)")
    engine, encoder, reader, info = build_engine(settings)
    engine.on_step = STEP_SECONDS.observe
    engine.start()
    store = CatalogStore.from_settings(settings)
    catalogs = CatalogManager(store, engine, settings.catalogs or None, encoder=encoder,
                              lease_seconds=settings.lease_seconds)
    servicer = DecoderServicer(engine, catalogs, info, reader)
    # A Discover stream holds a handler thread while it runs or waits: one per admitted or queued
    # request (plus a few for GetInfo and health), so the queue bound, not the pool, refuses work.
    credentials = server_credentials(settings)
    server, health = make_server(settings.decoder_addr,
                                 lambda s: pb_grpc.add_DecoderServiceServicer_to_server(servicer, s), [SERVICE],
                                 max_workers=engine.config.max_seqs + settings.max_waiting + 8,
                                 options=server_options(settings), credentials=credentials,
                                 reflection_on=settings.reflection, interceptors=[guard(settings)])
    start_metrics(settings.metrics_port, settings.metrics_host)
    server.start()
    log.info("decoder listening on %s (%s, %s on %s); warming catalogs", settings.decoder_addr,
             "TLS" if credentials else "plaintext", info["backend"], info["device"])
    catalogs.start()
    stop_metrics = threading.Event()
    threading.Thread(target=watch_metrics, args=(engine, stop_metrics), daemon=True).start()
    threading.Thread(target=follow_health, args=(catalogs, health, stop_metrics), daemon=True).start()

    def before_stop():
        stop_metrics.set()
        servicer.draining = True
        catalogs.stop()
    wait_for_termination(server, health, [SERVICE], grace=settings.drain_seconds, before_stop=before_stop,
                         at_drain_end=lambda: engine.stop(timeout=DRAIN_MARGIN / 2))


if __name__ == "__main__":
    setup_logging()
    try:
        serve()
    except AddressInUse as e:
        raise SystemExit(f"decoder: {e}") from None

"""The decoder service: streaming Discover and GetInfo over gRPC, catalogs followed from Redis.

`python -m decoder_service.server` loads the model (GPU when there is one, else the CPU backend),
loads and warms the latest version of each published catalog, reports SERVING on the standard
health service, and serves until SIGTERM, which drains in-flight requests first.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import uuid

import grpc
from prometheus_client import Counter, Gauge, Histogram

from decoder_service.catalogs import CatalogManager, CatalogRefused
from decoder_service.engine.engine import DecodeEngine, EngineConfig, Expired, QueueFull, RequestError
from decoder_service.engine.sequence import DoneEvent, FailedEvent, PointerEvent
from shared.config import Settings
from shared.rpc import decoder_pb2 as pb, decoder_pb2_grpc as pb_grpc
from shared.serving import (RPC_TOTAL, make_server, set_serving, setup_logging, start_metrics, status_for,
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
TOKENS_FORCED = Gauge("tooltrie_decoder_tokens_forced", "Answer tokens taken without a step (the last name's "
                      "forced tokens to the stop), since start")
FIRST_POINTER = Histogram("tooltrie_time_to_first_pointer_seconds", "From request to its first tool name")
STEP_SECONDS = Histogram("tooltrie_decode_step_seconds", "One engine step (forward pass and sampler)")
REQUESTS = Counter("tooltrie_discover_total", "Discover requests by outcome code", ["code"])

# Engine and catalog exceptions -> status codes (the shared ones come from shared.serving.status_for).
REFUSALS = [(RequestError, grpc.StatusCode.INVALID_ARGUMENT), (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
            (Expired, grpc.StatusCode.DEADLINE_EXCEEDED),
            (CatalogRefused, grpc.StatusCode.FAILED_PRECONDITION), (TimeoutError, grpc.StatusCode.UNAVAILABLE)]
FAILED_CODES = {"internal": grpc.StatusCode.INTERNAL, "deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
                "cancelled": grpc.StatusCode.CANCELLED}


def retrieved(rt, shortlist, k: int):
    """MODE_RETRIEVE's events: the shortlist's first k tools as the answer, then Done."""
    for i, pid in enumerate(shortlist.ids[:k]):
        pid = int(pid)
        yield PointerEvent(index=i, pointer_id=pid, name=rt.trie.pointer_names[pid],
                           token_ids=tuple(rt.trie.pointer_tokens(pid)), logprob=0.0)
    yield DoneEvent(prompt_tokens=0, generated_tokens=0, queue_ms=0.0, prefill_ms=0.0, decode_ms=0.0)


class DecoderServicer(pb_grpc.DecoderServiceServicer):
    def __init__(self, engine: DecodeEngine, catalogs: CatalogManager, info: dict):
        self.engine, self.catalogs, self.info = engine, catalogs, info
        self.draining = False

    def _abort(self, context, code: grpc.StatusCode, message: str):
        if code == grpc.StatusCode.INTERNAL:
            log.error("Discover failed: %s", message)
        REQUESTS.labels(code.name).inc()
        RPC_TOTAL.labels(SERVICE, "Discover", code.name).inc()
        context.abort(code, message)

    def Discover(self, request, context):
        started = time.monotonic()
        if self.draining:
            self._abort(context, grpc.StatusCode.UNAVAILABLE, "the decoder is shutting down")
        try:
            rt = self.catalogs.acquire(request.catalog, request.version)
        except Exception as e:  # noqa: BLE001 - mapped to a status
            self._abort(context, status_for(e, REFUSALS), str(e))
        seq = None  # once submitted, the engine releases the catalog pin when it lets go of the request
        try:
            try:
                shortlist = self.engine.retrieve(rt, request.intent, request.k, list(request.allow) or None,
                                                 request.shortlist)
                if request.mode != pb.MODE_RETRIEVE:
                    seq = self.engine.submit(rt, request.intent, request.k, request_id=request.request_id or None,
                                             timeout=context.time_remaining(), shortlist=shortlist,
                                             on_finish=lambda: self.catalogs.release(rt))
            except (RequestError, QueueFull, Expired) as e:
                self._abort(context, status_for(e, REFUSALS), str(e))
            if seq is not None and not context.add_callback(lambda: self.engine.cancel(seq)):
                self.engine.cancel(seq)  # the RPC ended before the callback could be added
            name, version = rt.key
            request_id = seq.request_id if seq is not None else request.request_id or uuid.uuid4().hex
            log.info("discover %s v%d k=%d", name, version, request.k, extra={"request_id": request_id})
            yield pb.DiscoverEvent(accepted=pb.Accepted(catalog=name, version=version, request_id=request_id))
            rank = {int(p): (r, float(shortlist.scores[r])) for r, p in enumerate(shortlist.ids)}
            events = seq if seq is not None else retrieved(rt, shortlist, request.k)
            for event in events:
                if isinstance(event, FailedEvent):
                    self._abort(context, FAILED_CODES.get(event.kind, grpc.StatusCode.INTERNAL), event.message)
                if isinstance(event, DoneEvent):
                    REQUESTS.labels("OK").inc()
                    RPC_TOTAL.labels(SERVICE, "Discover", "OK").inc()
                    yield pb.DiscoverEvent(done=pb.Done(**event.__dict__, retrieval_ms=shortlist.seconds * 1e3))
                    return
                if event.index == 0:
                    FIRST_POINTER.observe(time.monotonic() - started)
                r, score = rank[event.pointer_id]
                yield pb.DiscoverEvent(pointer=pb.Pointer(index=event.index, name=event.name,
                                                          token_ids=list(event.token_ids), logprob=event.logprob,
                                                          retrieval_score=score, retrieval_rank=r))
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


def build_engine(settings: Settings):
    """Model, backend, KV pool, engine and the retriever's encoder from the settings; returns (engine,
    encoder or None, info for GetInfo)."""
    from decoder_service.encoder import load_encoder
    from decoder_service.model.backend import make_backend, resolve_backend, weights_dtype
    from decoder_service.model.config import ModelConfig
    from decoder_service.model.kv_pool import KVPoolSpec
    from decoder_service.model.weights import load_weights
    from shared.tokenizer import ModelTokenizer
    cfg = ModelConfig.from_dir(settings.model_dir)
    kv_spec = KVPoolSpec.from_tokens(settings.kv_tokens)
    kind = resolve_backend(settings.backend)
    weights = load_weights(settings.model_dir, cfg, weights_dtype(kind, cfg))
    # The GPU backend's step buffers: a logit row per sequence, a block-table row per sequence.
    backend = make_backend(cfg, weights, kv_spec, backend=kind, max_logit_rows=settings.max_seqs,
                           max_table=settings.max_seqs * -(-cfg.max_position_embeddings // kv_spec.block_size))
    engine = DecodeEngine(backend, ModelTokenizer(settings.model_dir), num_blocks=kv_spec.num_blocks,
                          block_size=kv_spec.block_size, max_positions=cfg.max_position_embeddings,
                          config=EngineConfig(max_seqs=settings.max_seqs, max_waiting=settings.max_waiting,
                                              shortlist=settings.shortlist, fusion_weight=settings.fusion_weight))
    encoder = load_encoder(settings.encoder_dir, kind) if settings.encoder_dir else None
    info = {"model": str(settings.model_dir.name), "backend": kind, "device": device_name(kind),
            "encoder": encoder.name if encoder else ""}
    return engine, encoder, info


def device_name(kind: str) -> str:
    """What GetInfo reports as the device: the GPU's name, or the CPU's core count."""
    if kind == "cuda":
        from numba import cuda
        name = cuda.get_current_device().name
        return name.decode() if isinstance(name, bytes) else str(name)
    return f"cpu ({os.cpu_count()} cores)"


def watch_metrics(engine: DecodeEngine, stop: threading.Event) -> None:
    while not stop.wait(0.5):
        QUEUE_DEPTH.set(engine.queue_depth())
        RUNNING.set(len(engine.scheduler.running))
        KV_USED.set(engine.blocks.num_blocks - engine.blocks.num_free)
        KV_CONSISTENT.set(int(engine.blocks.consistent()))
        STEPS_AHEAD.set(engine.steps_ahead)
        STEPS_DROPPED.set(engine.steps_dropped)
        TOKENS_FORCED.set(engine.tokens_forced)


def serve(settings: Settings | None = None) -> None:
    settings = settings or Settings()
    if not settings.redis_url:
        raise SystemExit("REDIS_URL is not set: point it at a Redis (`make run` starts one for you)")
    engine, encoder, info = build_engine(settings)
    engine.on_step = STEP_SECONDS.observe
    engine.start()
    store = CatalogStore.from_url(settings.redis_url, settings.namespace)
    catalogs = CatalogManager(store, engine, settings.catalogs or None, encoder=encoder)
    servicer = DecoderServicer(engine, catalogs, info)
    # A Discover stream holds a handler thread while it runs or waits: one per admitted or queued
    # request (plus a few for GetInfo and health), so the queue bound, not the pool, refuses work.
    # Connections are recycled every few minutes (streams in flight get the drain period to finish),
    # so clients balancing round-robin over a headless Service re-resolve and find new replicas.
    age = [("grpc.max_connection_age_ms", 300_000),
           ("grpc.max_connection_age_grace_ms", int(settings.drain_seconds * 1000))]
    server, health = make_server(settings.decoder_addr,
                                 lambda s: pb_grpc.add_DecoderServiceServicer_to_server(servicer, s), [SERVICE],
                                 max_workers=settings.max_seqs + settings.max_waiting + 8, options=age)
    start_metrics(settings.metrics_port)
    server.start()
    log.info("decoder listening on %s (%s on %s); warming catalogs", settings.decoder_addr, info["backend"],
             info["device"])
    catalogs.start()
    stop_metrics = threading.Event()
    threading.Thread(target=watch_metrics, args=(engine, stop_metrics), daemon=True).start()

    def mark_ready():
        while not catalogs.ready():
            time.sleep(0.2)
        set_serving(health, [SERVICE], True)
        log.info("serving: %s", ", ".join(f"{c['name']} v{c['version']}" for c in catalogs.describe()))
    threading.Thread(target=mark_ready, daemon=True).start()

    def before_stop():
        servicer.draining = True
        catalogs.stop()
    wait_for_termination(server, health, [SERVICE], grace=settings.drain_seconds, before_stop=before_stop)
    stop_metrics.set()
    engine.stop()


if __name__ == "__main__":
    setup_logging()
    serve()

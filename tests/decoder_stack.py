"""A decoder over real gRPC and a real Redis (tiny random model, CPU backend), built the way serve() builds
it: the guard, the server options, the health follower. For the reliability and security tests."""
from __future__ import annotations

import json
import threading
import time
import uuid

import grpc

from compiler_service.compiler import compile_catalog
from decoder_service.catalogs import CatalogManager
from decoder_service.server import SERVICE, DecoderServicer, follow_health, guard, server_options
from devstack.redis_server import free_port
from engine_fixtures import make_engine, tiny_backend
from shared.catalog import registry_from_entries
from shared.rpc import decoder_pb2 as pb, decoder_pb2_grpc as pb_grpc
from shared.serving import make_server
from shared.store import CatalogStore
from shared.tokenizer import ModelTokenizer
from tokenizer_fixtures import catalog_path

NUM_BLOCKS = 1024
TOOLS = json.loads(catalog_path("metatool").read_text())[:30]


def trie_of(tok, tools):
    return compile_catalog(registry_from_entries(tools), tok)


class DecoderStack:
    def __init__(self, tmp_path, tokenizer_dir, redis_url, settings=None, credentials=None, namespace=None,
                 signing_key="", lease_seconds=60.0, warm_timeout=600.0, encoder=None, tuned_tools=frozenset(),
                 reader=None, **engine_config):
        from shared.config import Settings
        self.settings = settings or Settings()
        self.tok = ModelTokenizer(tokenizer_dir)
        backend = tiny_backend(tmp_path, self.tok.tokenizer.get_vocab_size(), NUM_BLOCKS)
        self.engine = make_engine(backend, self.tok, NUM_BLOCKS, tuned_tools, **{"max_waiting": 128, **engine_config})
        self.engine.start()
        self.ns = namespace or f"t-{uuid.uuid4().hex[:8]}"
        self.store = CatalogStore.from_url(redis_url, namespace=self.ns, signing_key=signing_key)
        self.catalogs = CatalogManager(self.store, self.engine, lease_seconds=lease_seconds,
                                       warm_timeout=warm_timeout, encoder=encoder)
        self.servicer = DecoderServicer(self.engine, self.catalogs, {"model": "tiny", "backend": "cpu",
                                                                     "device": "cpu"}, reader)
        self.addr = f"127.0.0.1:{free_port()}"
        self.server, self.health = make_server(
            self.addr, lambda s: pb_grpc.add_DecoderServiceServicer_to_server(self.servicer, s), [SERVICE],
            options=server_options(self.settings), credentials=credentials, reflection_on=self.settings.reflection,
            interceptors=[guard(self.settings)], max_workers=64)
        self.server.start()
        self.stop_event = threading.Event()
        threading.Thread(target=follow_health, args=(self.catalogs, self.health, self.stop_event, 0.05),
                         daemon=True).start()
        self.channel = None

    def start(self, wait_ready=True):
        self.catalogs.start()
        if wait_ready:
            wait_until(self.catalogs.ready, 60, "a catalog ready")
        return self

    def stub(self):
        if self.channel is None:
            self.channel = grpc.insecure_channel(self.addr)
        return pb_grpc.DecoderServiceStub(self.channel)

    def close(self):
        self.stop_event.set()
        if self.channel is not None:
            self.channel.close()
        self.server.stop(0)
        self.catalogs.stop()
        self.engine.stop()


def wait_until(predicate, timeout=30.0, what="condition", every=0.02):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


def discover(stub, timeout=60, metadata=None, **request):
    events = list(stub.Discover(pb.DiscoverRequest(**request), timeout=timeout, metadata=metadata))
    assert events[0].HasField("accepted") and events[-1].HasField("done")
    return events[0].accepted, [e.pointer for e in events[1:-1]]


def failure(stub, timeout=30, metadata=None, **request) -> grpc.RpcError | None:
    """The error a Discover call ends with, or None when it succeeds."""
    try:
        list(stub.Discover(pb.DiscoverRequest(**request), timeout=timeout, metadata=metadata))
    except grpc.RpcError as e:
        return e
    return None

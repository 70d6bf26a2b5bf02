"""Hot swap and readiness (issue 29, findings 3-5), real Redis and real gRPC: one corrupt catalog never
blocks the others; a newer publish supersedes a load in progress; accepted streams are never cut by
connection ageing; retention never deletes a version a decoder holds; the compiler's health follows Redis."""
import dataclasses
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decoder_stack import TOOLS, DecoderStack, discover, trie_of, wait_until
from devstack.redis_server import LocalRedis, free_port
from shared.config import Settings
from shared.serving import follow_redis, make_server
from shared.store import CatalogStore

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def check(addr, service=""):
    """The health status of a service name, or None where the server has published none for it yet."""
    with grpc.insecure_channel(addr) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                        timeout=5).status
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise


def test_a_truncated_catalog_does_not_keep_the_decoder_from_the_others(tmp_path, small_tokenizer_dir, redis_url):
    """Before: the follower restarted on the bad blob over and over, the healthy catalog never loaded and
    the decoder stayed NOT_SERVING."""
    s = DecoderStack(tmp_path, small_tokenizer_dir, redis_url)
    try:
        s.store.publish("aaa-broken", trie_of(s.tok, TOOLS[:5]))   # sorted first: reconciled first
        s.store.publish("healthy", trie_of(s.tok, TOOLS[5:15]))
        blob = s.store.blob("aaa-broken", 1)
        s.store.r.set(s.store._key("aaa-broken", "blob", 1), blob[: len(blob) // 2])
        s.start(wait_ready=False)
        wait_until(lambda: check(s.addr) == SERVING, 20, "the decoder SERVING")
        assert check(s.addr, "tooltrie.catalog.healthy") == SERVING
        assert check(s.addr, "tooltrie.catalog.aaa-broken") == NOT_SERVING
        assert discover(s.stub(), catalog="healthy", intent="x", k=2)[0].version == 1
    finally:
        s.close()


def test_a_newer_publish_supersedes_the_load_in_progress(tmp_path, small_tokenizer_dir, redis_url):
    """Six versions published while each takes a second to load: the newest is the default within about
    one load of its publish, and most of the versions in between are never loaded at all (before, every
    one was loaded, the newest behind the others)."""
    s = DecoderStack(tmp_path, small_tokenizer_dir, redis_url)
    try:
        s.store.publish("swap", trie_of(s.tok, TOOLS[:10]))
        s.start()
        loaded = []
        build = s.catalogs.retriever

        def slow(name, version, trie, superseded=None):
            loaded.append(version)
            time.sleep(1.0)
            return build(name, version, trie, superseded)
        s.catalogs.retriever = slow
        for i in range(6):
            info, _ = s.store.publish("swap", trie_of(s.tok, TOOLS[i + 1:i + 11]))
            published = time.monotonic()
            time.sleep(0.15)
        wait_until(lambda: s.catalogs.default_version("swap") == info.version, 10, "the newest version as the default")
        assert time.monotonic() - published < 2.6, "the newest waited behind older loads"
        assert loaded[-1] == info.version and len(loaded) <= 3, loaded
        assert discover(s.stub(), catalog="swap", intent="x", k=1)[0].version == info.version
    finally:
        s.close()


@pytest.mark.parametrize("options, survives", [("service", True), ("short grace (before)", False)])
def test_connection_ageing_never_cuts_an_accepted_stream(options, survives):
    """With the decoder's server options (connections aged after 1 s here) a stream open for 4 s keeps
    receiving; with a bounded grace (what the decoder had: the drain time) it is cut."""
    settings = dataclasses.replace(Settings(), max_connection_age_s=1.0)
    from decoder_service.server import server_options
    opts = server_options(settings) if options == "service" else \
        [("grpc.max_connection_age_ms", 1000), ("grpc.max_connection_age_grace_ms", 1000)]
    addr = f"127.0.0.1:{free_port()}"
    server, health = make_server(addr, lambda s: None, ["demo"], options=opts)
    server.start()
    try:
        with grpc.insecure_channel(addr) as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service="demo"), timeout=30)
            assert next(watch).status == NOT_SERVING
            time.sleep(4.0)
            health.set("demo", SERVING)
            if survives:
                assert next(watch).status == SERVING
            else:
                with pytest.raises(grpc.RpcError) as err:
                    next(watch)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)


def test_retention_never_deletes_a_version_a_decoder_holds(tmp_path, small_tokenizer_dir, redis_url):
    """A compiler keeping one version publishes three more while a request pins v1 on the decoder: v1 stays
    in Redis (the decoder's lease); once the pin is gone and the lease dropped, the next publish trims it."""
    s = DecoderStack(tmp_path, small_tokenizer_dir, redis_url, lease_seconds=3.0)
    try:
        s.store.publish("kept", trie_of(s.tok, TOOLS[:8]))
        s.start()
        compiler = CatalogStore(s.store.r, s.ns, keep_versions=1)
        pinned = s.catalogs.acquire("kept", 1)
        for i in range(3):
            compiler.publish("kept", trie_of(s.tok, TOOLS[i + 8:i + 16]))
        wait_until(lambda: s.catalogs.default_version("kept") == 4, 10, "v4 as the default")
        assert s.store.r.exists(s.store._key("kept", "blob", 1)), "a pinned version was trimmed"
        assert discover(s.stub(), catalog="kept", version=1, intent="x", k=1)[0].version == 1
        s.catalogs.release(pinned)
        s.catalogs.refresh_leases()
        compiler.publish("kept", trie_of(s.tok, TOOLS[20:28]))
        assert not s.store.r.exists(s.store._key("kept", "blob", 1))
    finally:
        s.close()


def test_an_expired_lease_no_longer_holds_a_version(redis_url, small_tokenizer_dir):
    from shared.tokenizer import ModelTokenizer
    tok = ModelTokenizer(small_tokenizer_dir)
    store = CatalogStore.from_url(redis_url, namespace=f"t-lease-{time.time_ns()}", keep_versions=1)
    tries = [trie_of(tok, TOOLS[i:i + 3]) for i in (0, 3, 6)]   # compiled first: only the store inside the lease
    store.publish("c", tries[0])
    store.lease("c", [1], "gone-decoder", ttl=0.5)
    store.publish("c", tries[1])
    assert store.leased("c") == {1} and store.r.exists(store._key("c", "blob", 1))
    time.sleep(0.6)
    store.publish("c", tries[2])
    assert store.leased("c") == set() and [v.version for v in store.list_versions("c")] == [3]


def test_compiler_health_follows_redis(tmp_path):
    """Before: SERVING while every call failed with UNAVAILABLE: redis unavailable."""
    redis_server = LocalRedis(tmp_path / "r", appendonly=False).start()
    store = CatalogStore.from_url(redis_server.url)
    addr = f"127.0.0.1:{free_port()}"
    server, health = make_server(addr, lambda s: None, ["tooltrie.v1.CompilerService"])
    server.start()
    stop = threading.Event()
    threading.Thread(target=follow_redis, args=(store.r.ping, health, ["tooltrie.v1.CompilerService"], stop, 0.1),
                     daemon=True).start()
    try:
        wait_until(lambda: check(addr) == SERVING, 5, "SERVING with Redis up")
        redis_server.stop()
        wait_until(lambda: check(addr) == NOT_SERVING, 10, "NOT_SERVING with Redis down")
        assert check(addr, "tooltrie.v1.CompilerService") == NOT_SERVING
        redis_server.start()
        wait_until(lambda: check(addr) == SERVING, 15, "SERVING again")
    finally:
        stop.set()
        server.stop(0)
        redis_server.stop()


def test_make_run_waits_for_its_own_catalog(tmp_path, small_tokenizer_dir, redis_url):
    """A small catalog left in Redis warms first: the decoder is SERVING, but devstack waits for the demo
    catalog's own health, so its questions never meet NOT_FOUND."""
    from devstack.stack import wait_serving
    s = DecoderStack(tmp_path, small_tokenizer_dir, redis_url)
    try:
        s.store.publish("leftover", trie_of(s.tok, TOOLS[:1]))
        s.start()
        build = s.catalogs.retriever
        s.catalogs.retriever = lambda *a: (time.sleep(1.5), build(*a))[1]
        s.store.publish("zdemo", trie_of(s.tok, TOOLS[:20]))

        class Running:
            def poll(self):
                return None
        wait_serving(s.addr, 20, Running(), service="tooltrie.catalog.zdemo")
        assert discover(s.stub(), catalog="zdemo", intent="weather", k=2)[0].catalog == "zdemo"
    finally:
        s.close()

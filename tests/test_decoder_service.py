"""The decoder over real gRPC against a real Redis, on the CPU backend with a tiny random model.

The model is tiny and random (the real one is exercised by the model tests); what is under test here
is the service: streaming, version pinning, hot swap under load, error codes, and freed KV blocks.
"""
import contextlib
import dataclasses
import json
import threading
import time
import uuid

import grpc
import pytest

from decoder_service.catalogs import CatalogManager
from decoder_service.server import SERVICE, DecoderServicer
from devstack.redis_server import free_port
from engine_fixtures import make_engine, paused, tiny_backend
from compiler_service.compiler import compile_catalog
from shared.catalog import registry_from_entries
from shared.rpc import decoder_pb2 as pb, decoder_pb2_grpc as pb_grpc
from shared.serving import make_server, set_serving
from shared.store import CatalogStore
from shared.tokenizer import ModelTokenizer
from tokenizer_fixtures import catalog_path

NUM_BLOCKS = 2048
LOADING = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE}   # not announced yet; announced and loading
TOOLS = json.loads(catalog_path("metatool").read_text())[:30]


def tries(tok, tools):
    return compile_catalog(registry_from_entries(tools), tok)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, small_tokenizer_dir, redis_url):
    tok = ModelTokenizer(small_tokenizer_dir)
    backend = tiny_backend(tmp_path_factory.mktemp("tiny"), tok.tokenizer.get_vocab_size(), NUM_BLOCKS)
    engine = make_engine(backend, tok, NUM_BLOCKS, max_waiting=64)
    engine.start()
    store = CatalogStore.from_url(redis_url, namespace=f"t-{uuid.uuid4().hex[:8]}")
    store.publish("demo", tries(tok, TOOLS))
    catalogs = CatalogManager(store, engine)
    catalogs.start()
    servicer = DecoderServicer(engine, catalogs, {"model": "tiny", "backend": "cpu", "device": "cpu"})
    addr = f"127.0.0.1:{free_port()}"
    server, health = make_server(addr, lambda s: pb_grpc.add_DecoderServiceServicer_to_server(servicer, s), [SERVICE])
    server.start()
    deadline = time.monotonic() + 60
    while not catalogs.ready():
        assert time.monotonic() < deadline, "catalog did not warm"
        time.sleep(0.05)
    set_serving(health, [SERVICE], True)
    channel = grpc.insecure_channel(addr)
    yield {"stub": pb_grpc.DecoderServiceStub(channel), "addr": addr, "store": store, "servicer": servicer, "tok": tok,
           "engine": engine, "catalogs": catalogs}
    channel.close()
    server.stop(0)
    catalogs.stop()
    engine.stop()


def discover(stub, **kw):
    events = list(stub.Discover(pb.DiscoverRequest(**kw), timeout=60))
    accepted, pointers, done = events[0].accepted, [e.pointer for e in events[1:-1]], events[-1].done
    assert events[0].HasField("accepted") and events[-1].HasField("done")
    return accepted, pointers, done


def test_discover_streams_exactly_k_distinct_names_of_the_pinned_version(stack):
    accepted, pointers, done = discover(stack["stub"], catalog="demo", intent="weather in Paris", k=3,
                                        request_id="req-1")
    assert accepted.catalog == "demo" and accepted.version >= 1 and accepted.request_id == "req-1"
    names = [p.name for p in pointers]
    assert [p.index for p in pointers] == [0, 1, 2] and len(set(names)) == 3
    assert set(names) <= {t["name"] for t in TOOLS}
    assert all(p.logprob <= 0 and p.token_ids for p in pointers) and done.generated_tokens >= 3


@pytest.mark.parametrize("request_, code, message", [
    (dict(catalog="nope", intent="x", k=1), grpc.StatusCode.NOT_FOUND, "no catalog named 'nope'"),
    (dict(catalog="demo", intent="x", k=0), grpc.StatusCode.INVALID_ARGUMENT, "k must be at least 1"),
    (dict(catalog="demo", intent="x", k=31), grpc.StatusCode.INVALID_ARGUMENT, "larger than the catalog"),
    (dict(catalog="demo", intent="", k=1), grpc.StatusCode.INVALID_ARGUMENT, "intent is empty"),
    (dict(catalog="demo", intent="x", k=1, allow=["missing"]), grpc.StatusCode.INVALID_ARGUMENT, "'missing'"),
    (dict(catalog="demo", version=999, intent="x", k=1), grpc.StatusCode.NOT_FOUND, "has no version 999"),
])
def test_error_codes(stack, request_, code, message):
    err = refusal(stack["stub"], **request_)
    assert err.code() == code and message in err.details()


def test_allowlist_through_the_service(stack):
    allowed = [t["name"] for t in TOOLS[3:6]]
    _, pointers, _ = discover(stack["stub"], catalog="demo", intent="anything", k=2, allow=allowed)
    assert {p.name for p in pointers} <= set(allowed)


def test_get_info(stack):
    info = stack["stub"].GetInfo(pb.GetInfoRequest())
    assert info.backend == "cpu" and info.kv_capacity_tokens == NUM_BLOCKS * 16
    assert any(c.name == "demo" and c.latest and c.ready for c in info.catalogs)


def test_deadline_and_cancellation_free_every_block(stack):
    """With the engine paused, one request's deadline passes and another is cancelled after Accepted;
    once the engine runs again both are dropped and the pool returns to its idle level."""
    engine, stub = stack["engine"], stack["stub"]
    time.sleep(0.2)
    idle = engine.blocks.num_free
    with paused(engine):
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Discover(pb.DiscoverRequest(catalog="demo", intent="too slow", k=3), timeout=0.3))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        call = stub.Discover(pb.DiscoverRequest(catalog="demo", intent="cancel me", k=3), timeout=30)
        assert next(call).HasField("accepted")
        call.cancel()
    deadline = time.monotonic() + 10
    while engine.blocks.num_free != idle or engine.scheduler.running or engine.scheduler.waiting:
        assert time.monotonic() < deadline, f"{idle - engine.blocks.num_free} blocks still held"
        time.sleep(0.05)


def test_hot_swap_under_load(stack):
    """While requests stream from several threads, publish new versions and roll one back: no request
    fails and every answer's names belong to the version its Accepted event names."""
    store, tok, stub = stack["store"], stack["tok"], stack["stub"]
    names_of = {}
    for info in store.list_versions("demo"):
        names_of[info.version] = {t["name"] for t in TOOLS}
    errors, answers, stop = [], [], threading.Event()

    def client(i):
        while not stop.is_set():
            try:
                accepted, pointers, _ = discover(stub, catalog="demo", intent=f"request {i} {len(answers)}", k=2)
                answers.append((accepted.version, [p.name for p in pointers]))
            except Exception as e:  # noqa: BLE001 - collected and asserted below
                errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for n in range(6):
        tools = TOOLS[n:n + 20] + [{"name": f"new_tool_{n}", "description": "added in this version"}]
        info, _ = store.publish("demo", tries(tok, tools))
        names_of[info.version] = {t["name"] for t in tools}
        time.sleep(0.4)
    store.set_latest("demo", info.version - 2)
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert len(answers) >= 20
    for version, names in answers:
        assert set(names) <= names_of[version], (version, names)
    assert {v for v, _ in answers} - {1} and stack["catalogs"].default_version("demo") == info.version - 2


def test_python_clients_and_cli(stack, capsys):
    import asyncio

    from tooltrie import cli
    from tooltrie.client import AsyncDecoderClient, DecoderClient
    addr = stack["addr"]
    with DecoderClient(addr) as client:
        tools = list(client.discover("demo", "find flights", k=2))
    assert [t.index for t in tools] == [0, 1] and client.done.generated_tokens >= 2

    async def run_async():
        c = AsyncDecoderClient(addr)
        try:
            return [t async for t in c.discover("demo", "find flights", k=2)]
        finally:
            await c.close()
    assert [t.name for t in asyncio.run(run_async())] == [t.name for t in tools]
    assert cli.main(["--decoder", addr, "discover", "find flights", "-k", "2", "--catalog", "demo"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"1. {tools[0].name}") and "prefill" in out
    assert cli.main(["--decoder", addr, "discover", "x", "-k", "0", "--catalog", "demo"]) == 2


def test_tokenizer_mismatch_is_failed_precondition(stack):
    trie = tries(stack["tok"], TOOLS[:5])
    trie.meta["tokenizer_hash"] = "f" * 64
    info, _ = stack["store"].publish("foreign", trie)
    deadline = time.monotonic() + 10
    while True:
        with pytest.raises(grpc.RpcError) as err:
            list(stack["stub"].Discover(pb.DiscoverRequest(catalog="foreign", intent="x", k=1), timeout=10))
        if err.value.code() not in LOADING or time.monotonic() > deadline:
            break
        time.sleep(0.1)  # the announcement is still being processed
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "compiled for tokenizer ffffffffffff" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        list(stack["stub"].Discover(pb.DiscoverRequest(catalog="foreign", version=info.version, intent="x", k=1)))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_engine_fault_is_internal(stack, monkeypatch):
    monkeypatch.setattr("decoder_service.engine.sampler.legal_edges", lambda *a: 0)
    err = refusal(stack["stub"], catalog="demo", intent="x", k=1)
    assert err.code() == grpc.StatusCode.INTERNAL and "empty mask" in err.details()


def refusal(stub, **request) -> grpc.RpcError:
    """The error a Discover call ends with (the test fails if it succeeds)."""
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Discover(pb.DiscoverRequest(**request), timeout=30))
    return err.value


def test_a_full_queue_is_resource_exhausted(stack, monkeypatch):
    monkeypatch.setattr(stack["engine"], "config", dataclasses.replace(stack["engine"].config, max_waiting=0))
    err = refusal(stack["stub"], catalog="demo", intent="x", k=1)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "the bound is 0" in err.details()


def test_an_explicit_older_version_is_served_on_demand(stack):
    store, tok, stub = stack["store"], stack["tok"], stack["stub"]
    old, _ = store.publish("ondemand", tries(stack["tok"], TOOLS[:8]))
    new, _ = store.publish("ondemand", tries(tok, TOOLS[8:16]))
    wait = time.monotonic() + 20
    while stack["catalogs"].default_version("ondemand") != new.version:
        assert time.monotonic() < wait
        time.sleep(0.05)
    accepted, pointers, _ = discover(stub, catalog="ondemand", version=old.version, intent="x", k=2)
    assert accepted.version == old.version and {p.name for p in pointers} <= {t["name"] for t in TOOLS[:8]}
    accepted, pointers, _ = discover(stub, catalog="ondemand", intent="x", k=2)
    assert accepted.version == new.version and {p.name for p in pointers} <= {t["name"] for t in TOOLS[8:16]}


def test_draining_refuses_new_requests_as_unavailable(stack, monkeypatch):
    monkeypatch.setattr(stack["servicer"], "draining", True)
    err = refusal(stack["stub"], catalog="demo", intent="x", k=1)
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.details()


def test_reflection_lists_the_decoder(stack):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
    services = ProtoReflectionDescriptorDatabase(grpc.insecure_channel(stack["addr"])).get_services()
    assert SERVICE in services and "grpc.health.v1.Health" in services


def test_a_catalog_whose_listing_exceeds_the_context_is_served(stack):
    """40 tools of 1,900 words each: far past the model's context listed whole, yet every request's prompt
    holds only its shortlist, descriptions cut to the template's budget."""
    huge = [{"name": f"tool_{i}", "description": f"topic{i} " + "word " * 1900} for i in range(40)]
    stack["store"].publish("huge", tries(stack["tok"], huge))
    deadline = time.monotonic() + 20
    while (err := refusal_or_none(stack["stub"], catalog="huge", intent="topic7", k=1)) is not None:
        assert err.code() in LOADING and time.monotonic() < deadline, err.details()
        time.sleep(0.1)
    _, pointers, done = discover(stack["stub"], catalog="huge", intent="topic7", k=2)
    assert len({p.name for p in pointers}) == 2 and done.prompt_tokens < 4096
    assert all(p.retrieval_rank < 20 for p in pointers)
    _, retrieved, _ = discover(stack["stub"], catalog="huge", intent="topic7", k=1, mode=pb.MODE_RETRIEVE)
    assert retrieved[0].name == "tool_7"


def refusal_or_none(stub, **request):
    """The error a Discover call ends with, or None when it succeeds."""
    try:
        list(stub.Discover(pb.DiscoverRequest(**request), timeout=60))
    except grpc.RpcError as e:
        return e
    return None


def test_a_request_that_expires_while_its_version_warms_never_runs(stack, monkeypatch):
    """Pinned to a version that is not loaded yet, with a deadline shorter than its warm-up: the client gets
    DEADLINE_EXCEEDED, the request never runs, and the version's blocks are released exactly once (the
    pool's invariant holds; it was left with more free blocks than it has, then failed later requests)."""
    store, catalogs, engine = stack["store"], stack["catalogs"], stack["engine"]
    build, submit = catalogs.retriever, engine.submit
    monkeypatch.setattr(catalogs, "retriever", lambda *a: (time.sleep(1.0), build(*a))[1])  # a slow warm-up

    stopped, hold = threading.Event(), contextlib.ExitStack()

    def submit_while_the_engine_waits(*a, **kw):
        hold.enter_context(paused(engine))   # as under load: what the handler queues lands before the next step
        stopped.set()
        return submit(*a, **kw)
    monkeypatch.setattr(engine, "submit", submit_while_the_engine_waits)
    info, _ = store.publish("slowdemo", tries(stack["tok"], TOOLS[:12]))   # pinned below, never the default:
    store.publish("slowdemo", tries(stack["tok"], TOOLS[:13]))               # released when its request lets go
    with pytest.raises(grpc.RpcError) as e:
        list(stack["stub"].Discover(pb.DiscoverRequest(catalog="slowdemo", version=info.version, intent="weather",
                                                       k=2), timeout=0.3))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert stopped.wait(10), "the handler never reached submit"   # it finishes its load after the client gave up
    time.sleep(0.5)   # and its stream ends
    try:
        engine.run_until_idle()   # a request admitted on its released version frees its blocks twice here
    finally:
        monkeypatch.setattr(engine, "submit", submit)
        hold.close()
    assert engine.blocks.consistent() and engine.blocks.num_free <= engine.blocks.num_blocks
    for _ in range(3):
        _, pointers, _ = discover(stack["stub"], catalog="demo", intent="book a flight", k=2)
        assert len(pointers) == 2
    assert engine.blocks.consistent()


def test_retrieve_mode_answers_the_shortlists_first_k_with_their_scores(stack):
    _, pointers, done = discover(stack["stub"], catalog="demo", intent="weather forecast", k=3,
                                 mode=pb.MODE_RETRIEVE, shortlist=5)
    assert [p.retrieval_rank for p in pointers] == [0, 1, 2] and done.generated_tokens == 0
    scores = [p.retrieval_score for p in pointers]
    assert scores == sorted(scores, reverse=True) and all(p.token_ids for p in pointers)
    tok = stack["tok"]
    assert [tok.decode(p.token_ids) for p in pointers] == [p.name for p in pointers]
    _, decoded, done = discover(stack["stub"], catalog="demo", intent="weather forecast", k=3, shortlist=5)
    assert {p.retrieval_rank for p in decoded} <= set(range(5)) and done.retrieval_ms > 0

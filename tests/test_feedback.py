"""Feedback and Learn over real gRPC against a real Redis: what callers chose becomes examples of a new version."""
import json
import uuid

import grpc
import pytest

from compiler_service.server import SERVICE, CompilerServicer, guard
from devstack.redis_server import free_port
from shared import feedback
from shared.config import Settings
from shared.feedback import FeedbackStore
from shared.rpc import compiler_pb2 as pb, compiler_pb2_grpc as pb_grpc
from shared.serving import make_server
from shared.store import CatalogStore
from shared.tokenizer import ModelTokenizer
from shared.trie import Trie

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
REGISTRY = json.dumps([{"name": "weather", "description": "forecasts", "inputSchema": SCHEMA},
                       {"name": "news", "description": "headlines", "examples": ["latest headlines"]},
                       {"name": "maps"}])
TOKEN = [("authorization", "Bearer s3cret")]


@pytest.fixture
def compiler(small_tokenizer_dir, redis_url):
    store = CatalogStore.from_url(redis_url, namespace=f"t-{uuid.uuid4().hex[:8]}")
    settings = Settings(publish_token="s3cret")
    servicer = CompilerServicer(ModelTokenizer(small_tokenizer_dir), store, settings)
    addr = f"127.0.0.1:{free_port()}"
    server, _ = make_server(addr, lambda s: pb_grpc.add_CompilerServiceServicer_to_server(servicer, s), [SERVICE],
                            interceptors=[guard(settings)])
    server.start()
    channel = grpc.insecure_channel(addr)
    stub = pb_grpc.CompilerServiceStub(channel)
    stub.Publish(pb.PublishRequest(name="demo", registry_json=REGISTRY), metadata=TOKEN)
    yield stub, store
    channel.close()
    server.stop(0)


def examples_of(stub, version: int) -> dict[str, list[str]]:
    blob = stub.GetCatalog(pb.GetCatalogRequest(name="demo", version=version, include_blob=True), metadata=TOKEN).blob
    trie = Trie.from_blob(blob)
    return dict(zip(trie.pointer_names, trie.meta["examples"]))


def send(stub, intent, tools, version=1, name="demo", metadata=TOKEN):
    return stub.Feedback(pb.FeedbackRequest(name=name, version=version, intent=intent, tools=tools),
                         metadata=metadata)


def test_learn_publishes_the_feedback_as_examples_and_rolls_back(compiler):
    stub, _ = compiler
    send(stub, "will it rain in Oslo tomorrow?", ["weather"])
    send(stub, "will it rain in Oslo tomorrow?", ["weather"])      # kept once
    send(stub, "latest headlines", ["news"])                        # already an example
    send(stub, "weather and news for Rome", ["weather", "news"])   # several tools: no example of either
    reply = stub.Learn(pb.LearnRequest(name="demo"), metadata=TOKEN)
    assert reply.created and reply.version.version == 2 and reply.version.latest and reply.examples_added == 1
    assert examples_of(stub, 2) == {"weather": ["will it rain in Oslo tomorrow?"], "news": ["latest headlines"],
                                    "maps": []}
    blob = stub.GetCatalog(pb.GetCatalogRequest(name="demo", version=2, include_blob=True), metadata=TOKEN).blob
    trie = Trie.from_blob(blob)
    assert json.loads(trie.definition(trie.pointer_names.index("weather"))["input_schema"]) == SCHEMA
    again = stub.Learn(pb.LearnRequest(name="demo"), metadata=TOKEN)
    assert not again.created and again.version.version == 2 and again.examples_added == 0
    assert stub.SetLatest(pb.SetLatestRequest(name="demo", version=1), metadata=TOKEN).version.latest


@pytest.mark.parametrize("request_, code, message", [
    (dict(version=7), grpc.StatusCode.NOT_FOUND, "has no version 7"),
    (dict(name="nope"), grpc.StatusCode.NOT_FOUND, "no version 1"),
    (dict(version=0), grpc.StatusCode.INVALID_ARGUMENT, "version must be"),
    (dict(name="bad name"), grpc.StatusCode.INVALID_ARGUMENT, "catalog name 'bad name' is not valid"),
    (dict(tools=["sunshine"]), grpc.StatusCode.INVALID_ARGUMENT, "has no tool named 'sunshine'"),
    (dict(tools=[]), grpc.StatusCode.INVALID_ARGUMENT, "names 1 to 16 tools"),
    (dict(tools=["weather", "weather"]), grpc.StatusCode.INVALID_ARGUMENT, "names a tool twice"),
    (dict(tools=["w" * 300]), grpc.StatusCode.INVALID_ARGUMENT, "over the limit of 256"),
    (dict(intent="  "), grpc.StatusCode.INVALID_ARGUMENT, "the intent is empty"),
    (dict(intent="x" * 4001), grpc.StatusCode.INVALID_ARGUMENT, "over the limit of 4000"),
    (dict(intent="rain\x00"), grpc.StatusCode.INVALID_ARGUMENT, "control character"),
    (dict(intent="rain <|im_end|>"), grpc.StatusCode.INVALID_ARGUMENT, "special token"),
])
def test_bad_feedback_is_one_clear_error_and_stores_nothing(compiler, request_, code, message):
    stub, _ = compiler
    with pytest.raises(grpc.RpcError) as err:
        send(stub, **{"intent": "will it rain?", "tools": ["weather"], **request_})
    assert err.value.code() == code and message in err.value.details()
    assert not stub.Learn(pb.LearnRequest(name="demo"), metadata=TOKEN).created


def test_feedback_and_learn_need_the_publish_token(compiler):
    stub, _ = compiler
    for call in (lambda: send(stub, "will it rain?", ["weather"], metadata=None),
                 lambda: stub.Learn(pb.LearnRequest(name="demo"))):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert not stub.Learn(pb.LearnRequest(name="demo"), metadata=TOKEN).created


def test_each_tool_keeps_its_newest_intents(compiler, monkeypatch):
    _, store = compiler
    monkeypatch.setattr(feedback, "PER_TOOL", 3)
    kept = FeedbackStore(store)
    for i in range(5):
        kept.record("demo", f"request {i}", ["weather"])
    kept.record("demo", "request 2", ["weather"])        # again: to the front, not a second place
    assert kept.alone("demo", ["weather", "news"]) == {"weather": ["request 3", "request 4", "request 2"]}


def test_two_learns_at_once_lose_neither_ones_examples(compiler):
    """Before: Learn checked that its version was still the latest, then published: a Learn that landed between
    the two (its examples in a version published there) was published over by one built without them."""
    stub, store = compiler
    send(stub, "will it rain in Oslo tomorrow?", ["weather"])
    publish, racing = store.publish, []

    def with_a_learn_landing_first(name, trie, **kw):
        if not racing:   # the first Learn's publish: a second Learn, with newer feedback, gets there first
            racing.append(True)
            send(stub, "headlines from Kyiv", ["news"])
            assert stub.Learn(pb.LearnRequest(name="demo"), metadata=TOKEN).version.version == 2
        return publish(name, trie, **kw)
    store.publish = with_a_learn_landing_first
    reply = stub.Learn(pb.LearnRequest(name="demo"), metadata=TOKEN)
    latest = stub.ListVersions(pb.ListVersionsRequest(name="demo")).versions[-1]
    assert not reply.created and reply.version.version == latest.version == 2
    assert examples_of(stub, 2) == {"weather": ["will it rain in Oslo tomorrow?"],
                                    "news": ["latest headlines", "headlines from Kyiv"], "maps": []}


def test_a_learn_that_never_finds_its_version_latest_is_aborted(compiler):
    """Each time Learn is about to publish, a registry's version has come: after LEARN_ATTEMPTS tries, ABORTED,
    and nothing of its own published."""
    stub, store = compiler
    send(stub, "will it rain in Oslo tomorrow?", ["weather"])
    publish, landed = store.publish, []

    def a_registry_landing_first(name, trie, **kw):
        if kw.get("on_latest") is not None:   # Learn's publish
            landed.append(json.loads(REGISTRY) + [{"name": f"extra_{len(landed)}"}])
            stub.Publish(pb.PublishRequest(name="demo", registry_json=json.dumps(landed[-1])), metadata=TOKEN)
        return publish(name, trie, **kw)
    store.publish = a_registry_landing_first
    with pytest.raises(grpc.RpcError) as err:
        stub.Learn(pb.LearnRequest(name="demo"), metadata=TOKEN)
    assert err.value.code() == grpc.StatusCode.ABORTED and "changed while learning, 3 times" in err.value.details()
    assert [v.version for v in stub.ListVersions(pb.ListVersionsRequest(name="demo")).versions] == [1, 2, 3, 4]
    assert examples_of(stub, 4)["weather"] == []

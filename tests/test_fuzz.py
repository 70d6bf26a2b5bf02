"""Fuzzing the two services over real gRPC (issue 29, finding 6): registries and Discover requests from
hypothesis, and raw bytes that are no message at all. Bad input is INVALID_ARGUMENT (or NOT_FOUND for a
well-formed name that does not exist), never INTERNAL or UNKNOWN, and no error echoes unbounded input.

`make test` runs a bounded number of cases (TOOLTRIE_FUZZ_EXAMPLES, default 200 per property);
`make fuzz` runs 10^5 in all and prints the counts by status code."""
import collections
import json
import os

import grpc
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from decoder_stack import TOOLS, DecoderStack, trie_of
from shared.rpc import compiler_pb2 as cpb, compiler_pb2_grpc as cpb_grpc
from shared.rpc import decoder_pb2 as pb
from test_tls import start_compiler

EXAMPLES = int(os.environ.get("TOOLTRIE_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 1000,
                suppress_health_check=list(HealthCheck))
BAD_INPUT = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION}
MAX_DETAILS = 2000
COUNTS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


def outcome(kind, call) -> grpc.StatusCode:
    try:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, (bytes, str)):
            list(result)
        code = grpc.StatusCode.OK
    except grpc.RpcError as e:
        code = e.code()
        assert len(e.details() or "") <= MAX_DETAILS, (code, len(e.details()))
    COUNTS[kind][code.name] += 1
    assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), code
    return code


@pytest.fixture(scope="module")
def compiler(small_tokenizer_dir, redis_url):
    from shared.config import Settings
    server, addr = start_compiler(Settings(), small_tokenizer_dir, redis_url)
    channel = grpc.insecure_channel(addr, options=[("grpc.max_send_message_length", 64 << 20)])
    yield cpb_grpc.CompilerServiceStub(channel), channel
    channel.close()
    server.stop(0)


@pytest.fixture(scope="module")
def decoder(tmp_path_factory, small_tokenizer_dir, redis_url):
    s = DecoderStack(tmp_path_factory.mktemp("fuzz"), small_tokenizer_dir, redis_url)
    s.store.publish("demo", trie_of(s.tok, TOOLS))
    s.start()
    yield s
    s.close()


def teardown_module():
    for kind, counts in sorted(COUNTS.items()):
        print(f"\nfuzz {kind}: {sum(counts.values())} cases: " +
              ", ".join(f"{c} {n}" for c, n in counts.most_common()))


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
                    lambda inner: (st.lists(inner, max_size=5)
                                   | st.dictionaries(st.text(max_size=12), inner, max_size=5)),
                    max_leaves=30)
NAMES = st.text(max_size=300) | st.sampled_from(["", " ", "a\x00b", "<|im_end|>", "x" * 300, "é", "e\u0301"])
TOOL = st.fixed_dictionaries({"name": NAMES}, optional={"description": st.text(max_size=100) | st.integers(),
                                                       "examples": st.lists(st.text(max_size=20), max_size=3) | JSON})
PLAIN = st.from_regex(r"[A-Za-z][A-Za-z0-9_]{0,20}", fullmatch=True)
VALID = st.lists(st.fixed_dictionaries({"name": PLAIN}, optional={"description": st.text(max_size=60)}),
                 min_size=1, max_size=5, unique_by=lambda t: t["name"].lower()).map(json.dumps)
REGISTRIES = (VALID | VALID | JSON.map(json.dumps) | st.lists(TOOL, max_size=6).map(json.dumps)
              | st.lists(TOOL, max_size=4).map(lambda t: json.dumps({"tools": t}))
              | st.text(max_size=200))


@FUZZ
@given(registry=REGISTRIES, name=PLAIN | NAMES)
def test_registries(compiler, registry, name):
    stub, _ = compiler
    outcome("Compile", lambda: stub.Compile(cpb.CompileRequest(registry_json=registry), timeout=30))
    code = outcome("Publish", lambda: stub.Publish(cpb.PublishRequest(name=name, registry_json=registry), timeout=30))
    assert code in BAD_INPUT | {grpc.StatusCode.OK}


@FUZZ
@given(catalog=st.just("demo") | st.just("demo") | NAMES,
       intent=st.sampled_from(["weather in Paris", "book a flight"]) | st.text(max_size=300),
       k=st.integers(1, 3) | st.integers(-5, 40), version=st.just(0) | st.integers(-3, 3),
       allow=st.just([]) | st.lists(st.sampled_from([t["name"] for t in TOOLS]) | NAMES, max_size=6),
       request_id=st.just("") | st.text(max_size=200), shortlist=st.just(0) | st.integers(-2, 300),
       mode=st.integers(0, 1) | st.integers(0, 3))
def test_discover_requests(decoder, catalog, intent, k, version, allow, request_id, shortlist, mode):
    request = pb.DiscoverRequest(catalog=catalog, intent=intent, k=k, version=version, allow=allow,
                                 request_id=request_id, shortlist=shortlist, mode=mode)
    code = outcome("Discover", lambda: decoder.stub().Discover(request, timeout=30))
    assert code in BAD_INPUT | {grpc.StatusCode.OK}


METHODS = ["/tooltrie.v1.CompilerService/Compile", "/tooltrie.v1.CompilerService/Publish",
           "/tooltrie.v1.CompilerService/GetCatalog", "/tooltrie.v1.CompilerService/SetLatest"]


@FUZZ
@given(data=st.binary(max_size=200), method=st.sampled_from(METHODS))
def test_raw_bytes(compiler, decoder, data, method):
    """Bytes that may not be a message at all (gRPC's own answer would be INTERNAL)."""
    _, channel = compiler
    call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    outcome("raw-compiler", lambda: call(data, timeout=30))
    with grpc.insecure_channel(decoder.addr) as decoder_channel:   # closed after each example
        stream = decoder_channel.unary_stream("/tooltrie.v1.DecoderService/Discover", request_serializer=None,
                                              response_deserializer=None)
        outcome("raw-Discover", lambda: stream(data, timeout=30))


def test_the_issues_inputs(compiler, decoder):
    stub, channel = compiler
    deep = "[" * 5000 + "]" * 5000
    code = outcome("Publish", lambda: stub.Publish(cpb.PublishRequest(name="deep", registry_json=deep), timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        stub.Publish(cpb.PublishRequest(name="deep", registry_json=deep))
    assert "nested too deeply" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:   # not UTF-8 in a string field: undecodable
        channel.unary_unary(METHODS[0], request_serializer=None, response_deserializer=None)(b"\x0a\x02\xff\xfe")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a valid Compile message" in err.value.details()
    long = "c" * 10_000
    for call in (lambda: list(decoder.stub().Discover(pb.DiscoverRequest(catalog=long, intent="x", k=1))),
                 lambda: stub.ListVersions(cpb.ListVersionsRequest(name=long)),
                 lambda: list(decoder.stub().Discover(pb.DiscoverRequest(catalog="demo", intent="x", k=1,
                                                                         allow=[long]))),
                 lambda: list(decoder.stub().Discover(pb.DiscoverRequest(catalog="demo", intent="x", k=1,
                                                                         request_id=long))),
                 lambda: list(decoder.stub().Discover(pb.DiscoverRequest(catalog="demo", intent="x", k=1,
                                                                         allow=["a"] * 20_000)))):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(err.value.details()) < 400, \
            err.value.details()[:200]
    registry = json.dumps([{"name": long}, {"name": "b"}])
    with pytest.raises(grpc.RpcError) as err:
        stub.Publish(cpb.PublishRequest(name="ok", registry_json=registry))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(err.value.details()) < 400

"""Access control (issue 29, finding 7): Publish, SetLatest (rollback) and blob reads need the publish token
(or an allowed client certificate: tests/test_tls.py), Discover and GetInfo the discover token when one is
set; reflection is off unless enabled. Real gRPC, real Redis."""
import dataclasses
import json
import threading
import time

import grpc
import pytest

from decoder_stack import TOOLS, DecoderStack, discover, failure, trie_of
from shared.config import Settings
from shared.rpc import compiler_pb2 as pb, compiler_pb2_grpc as pb_grpc
from test_tls import start_compiler
from tooltrie import cli
from tooltrie.client import DecoderClient, bearer

REGISTRY = json.dumps([{"name": "weather", "description": "forecasts"}, {"name": "news"}])


@pytest.fixture
def compiler(small_tokenizer_dir, redis_url):
    settings = dataclasses.replace(Settings(), publish_token="pub-token-1")
    server, addr = start_compiler(settings, small_tokenizer_dir, redis_url)
    channel = grpc.insecure_channel(addr)
    yield pb_grpc.CompilerServiceStub(channel), addr
    channel.close()
    server.stop(0)


def code_of(call):
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def test_publishing_rollback_and_blob_reads_need_the_token(compiler):
    stub, _ = compiler
    good, wrong = bearer("pub-token-1"), bearer("pub-token-2")
    for metadata in (None, wrong, [("authorization", "pub-token-1")]):   # none, wrong, not a bearer
        request = pb.PublishRequest(name="a", registry_json=REGISTRY)
        code, details = code_of(lambda request=request, metadata=metadata: stub.Publish(request, metadata=metadata))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "pub-token" not in details
    assert list(stub.ListCatalogs(pb.ListCatalogsRequest()).latest) == []   # nothing was published
    assert stub.Publish(pb.PublishRequest(name="a", registry_json=REGISTRY), metadata=good).created
    stub.Publish(pb.PublishRequest(name="a", registry_json='[{"name": "maps"}]'), metadata=good)
    code, _ = code_of(lambda: stub.SetLatest(pb.SetLatestRequest(name="a", version=1)))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert stub.GetCatalog(pb.GetCatalogRequest(name="a")).version.version == 2
    assert stub.SetLatest(pb.SetLatestRequest(name="a", version=1), metadata=good).version.latest
    code, _ = code_of(lambda: stub.GetCatalog(pb.GetCatalogRequest(name="a", include_blob=True)))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert stub.GetCatalog(pb.GetCatalogRequest(name="a", include_blob=True), metadata=good).blob
    # reading names and versions stays open; compiling costs what publishing does, so it needs the token too
    assert stub.GetCatalog(pb.GetCatalogRequest(name="a")).tool_names
    code, _ = code_of(lambda: stub.Compile(pb.CompileRequest(registry_json=REGISTRY)))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert stub.Compile(pb.CompileRequest(registry_json=REGISTRY), metadata=good).stats.tools == 2
    # two authorization headers: refused, whichever of them is good
    for two in (good + wrong, wrong + good):
        code, details = code_of(lambda two=two: stub.Compile(pb.CompileRequest(registry_json=REGISTRY), metadata=two))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "more than one authorization header" in details


def test_a_compile_waits_its_turn_and_is_refused_past_its_deadline(compiler, monkeypatch):
    """Registries compile one at a time (a huge one takes about 0.5 GB): a call that cannot start before its
    deadline is RESOURCE_EXHAUSTED, and the one under way finishes."""
    from compiler_service import server
    stub, _ = compiler
    gate, compile_catalog = threading.Event(), server.compile_catalog
    monkeypatch.setattr(server, "compile_catalog", lambda *a: (gate.wait(10), compile_catalog(*a))[1])
    request, token = pb.CompileRequest(registry_json=REGISTRY), bearer("pub-token-1")
    first = stub.Compile.future(request, metadata=token)
    time.sleep(0.3)
    code, details = code_of(lambda: stub.Compile(request, timeout=2, metadata=token))
    gate.set()
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "the compiler is busy" in details
    assert first.result(timeout=10).stats.tools == 2


def test_the_cli_sends_the_publish_token_and_says_when_latest_moves(compiler, tmp_path, monkeypatch, capsys):
    _, addr = compiler
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(REGISTRY)
    second.write_text('[{"name": "maps"}]')
    assert cli.main(["--compiler", addr, "publish", str(first), "--name", "c"]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    monkeypatch.setenv("TOOLTRIE_PUBLISH_TOKEN", "pub-token-1")
    assert cli.main(["--compiler", addr, "publish", str(first), "--name", "c"]) == 0
    assert cli.main(["--compiler", addr, "publish", str(second), "--name", "c"]) == 0
    assert cli.main(["--compiler", addr, "publish", str(first), "--name", "c"]) == 0   # identical to v1
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["published: c v1 (2 tools)", "published: c v2 (1 tools)"]
    assert out[2].startswith("unchanged: identical to c v1, which is the latest again (was v2")
    assert cli.main(["--compiler", addr, "publish", str(first), "--name", "c"]) == 0
    assert capsys.readouterr().out == "unchanged: c v1 (2 tools)\n"
    assert cli.main(["--compiler", addr, "rollback", "c", "2"]) == 0


def test_discover_token_when_set(tmp_path, small_tokenizer_dir, redis_url):
    settings = dataclasses.replace(Settings(), discover_token="disc-token")
    s = DecoderStack(tmp_path, small_tokenizer_dir, redis_url, settings=settings)
    try:
        s.store.publish("demo", trie_of(s.tok, TOOLS[:10]))
        s.start()
        err = failure(s.stub(), catalog="demo", intent="x", k=1)
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert discover(s.stub(), metadata=bearer("disc-token"), catalog="demo", intent="x", k=1)[0].version == 1
        with DecoderClient(s.addr, token="disc-token") as client:
            assert len(list(client.discover("demo", "x", k=2))) == 2
            assert client.info().backend == "cpu"
    finally:
        s.close()


def test_reflection_is_off_unless_enabled(tmp_path, small_tokenizer_dir, redis_url):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
    s = DecoderStack(tmp_path, small_tokenizer_dir, redis_url)
    try:
        with grpc.insecure_channel(s.addr) as ch:
            with pytest.raises(grpc.RpcError) as err:
                ProtoReflectionDescriptorDatabase(ch).get_services()
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        s.close()


def test_settings_are_listed_by_tooltrie_env(monkeypatch, capsys):
    monkeypatch.setenv("TOOLTRIE_PUBLISH_TOKEN", "very-secret")
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert "TOOLTRIE_PUBLISH_TOKEN=(set)" in out and "very-secret" not in out
    from shared.config import ENV_VARS
    assert all(f"{name}=" in out for name in ENV_VARS)

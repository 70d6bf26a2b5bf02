"""The compiler over real gRPC (server and client) against a real Redis, and the tooltrie CLI."""
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from compiler_service.server import SERVICE, CompilerServicer
from devstack.redis_server import LocalRedis, free_port
from shared.config import Settings
from shared.rpc import compiler_pb2 as pb, compiler_pb2_grpc as pb_grpc
from shared.serving import make_server, set_serving
from shared.store import CatalogStore
from shared.tokenizer import ModelTokenizer
from tokenizer_fixtures import catalog_path
from tooltrie import cli

REGISTRY = json.dumps([{"name": "weather", "description": "forecasts"}, {"name": "news", "description": "headlines"}])


def start_compiler(tokenizer_dir, redis_url):
    store = CatalogStore.from_url(redis_url, namespace=f"t-{uuid.uuid4().hex[:8]}")
    servicer = CompilerServicer(ModelTokenizer(tokenizer_dir), store, Settings())
    addr = f"127.0.0.1:{free_port()}"
    server, health = make_server(addr, lambda s: pb_grpc.add_CompilerServiceServicer_to_server(servicer, s), [SERVICE])
    server.start()
    set_serving(health, [SERVICE], True)
    return server, addr


@pytest.fixture
def compiler(small_tokenizer_dir, redis_url):
    server, addr = start_compiler(small_tokenizer_dir, redis_url)
    channel = grpc.insecure_channel(addr)
    yield pb_grpc.CompilerServiceStub(channel), addr
    channel.close()
    server.stop(0)


def test_compile_publish_list_get_rollback(compiler):
    stub, _ = compiler
    stats = stub.Compile(pb.CompileRequest(registry_json=REGISTRY)).stats
    assert stats.tools == 2 and stats.fits_constant_memory and stats.nodes > 2
    first = stub.Publish(pb.PublishRequest(name="demo", registry_json=REGISTRY))
    assert first.created and first.version.version == 1 and first.version.latest
    again = stub.Publish(pb.PublishRequest(name="demo", registry_json=REGISTRY))
    assert not again.created and again.version.version == 1
    second = stub.Publish(pb.PublishRequest(name="demo", registry_json=json.dumps([{"name": "maps"}])))
    assert second.version.version == 2
    assert [v.version for v in stub.ListVersions(pb.ListVersionsRequest(name="demo")).versions] == [1, 2]
    assert [(c.name, c.version) for c in stub.ListCatalogs(pb.ListCatalogsRequest()).latest] == [("demo", 2)]
    got = stub.GetCatalog(pb.GetCatalogRequest(name="demo", version=1, include_blob=True))
    assert sorted(got.tool_names) == ["news", "weather"] and got.blob[:8]
    assert stub.SetLatest(pb.SetLatestRequest(name="demo", version=1)).version.latest
    assert stub.GetCatalog(pb.GetCatalogRequest(name="demo")).version.version == 1


@pytest.mark.parametrize("request_, message", [
    (pb.PublishRequest(name="demo", registry_json="[]"), "holds no tools"),
    (pb.PublishRequest(name="demo", registry_json='[{"name": "a"}, {"name": "a"}]'), "duplicates tool #0"),
    (pb.PublishRequest(name="bad name", registry_json=REGISTRY), "catalog name 'bad name' is not valid"),
    (pb.PublishRequest(name="demo", registry_json="{oops"), "malformed JSON"),
])
def test_bad_input_is_invalid_argument_and_publishes_nothing(compiler, request_, message):
    stub, _ = compiler
    with pytest.raises(grpc.RpcError) as err:
        stub.Publish(request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()
    assert list(stub.ListCatalogs(pb.ListCatalogsRequest()).latest) == []


def test_unknown_catalog_and_version_are_not_found(compiler):
    stub, _ = compiler
    for call in (lambda: stub.ListVersions(pb.ListVersionsRequest(name="nope")),
                 lambda: stub.GetCatalog(pb.GetCatalogRequest(name="nope")),
                 lambda: stub.SetLatest(pb.SetLatestRequest(name="nope", version=3))):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_redis_down_is_unavailable_and_the_next_call_works_once_it_is_back(small_tokenizer_dir, tmp_path):
    redis_server = LocalRedis(tmp_path / "r", appendonly=True).start()
    server, addr = start_compiler(small_tokenizer_dir, redis_server.url)
    stub = pb_grpc.CompilerServiceStub(grpc.insecure_channel(addr))
    try:
        assert stub.Publish(pb.PublishRequest(name="demo", registry_json=REGISTRY)).version.version == 1
        redis_server.stop()
        with pytest.raises(grpc.RpcError) as err:
            stub.Publish(pb.PublishRequest(name="demo", registry_json=json.dumps([{"name": "x"}])))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert err.value.details() == "redis is unavailable; retry shortly"   # never its address
        redis_server.start()  # same port, same data directory (append-only file)
        reply = stub.Publish(pb.PublishRequest(name="demo", registry_json=json.dumps([{"name": "x"}])))
        assert reply.version.version == 2
    finally:
        server.stop(0)
        redis_server.stop()


def test_health_reflection_and_sigterm_in_a_real_process(small_tokenizer_dir, redis_url):
    port = free_port()
    env = {**os.environ, "REDIS_URL": redis_url, "TOOLTRIE_MODEL_DIR": str(small_tokenizer_dir),
           "TOOLTRIE_COMPILER_ADDR": f"127.0.0.1:{port}", "TOOLTRIE_METRICS_PORT": "0",
           "TOOLTRIE_DRAIN_SECONDS": "2", "TOOLTRIE_REFLECTION": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "compiler_service.server"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=30)
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 30
        while health.Check(health_pb2.HealthCheckRequest(service=SERVICE)).status != \
                health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
        assert SERVICE in services and "grpc.health.v1.Health" in services
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)   # reads the log meanwhile: a full pipe would block the server
        assert proc.returncode == 0 and '"msg": "stopped"' in out, out[-3000:]
    finally:
        proc.kill()


def test_cli_compile_prints_stats_as_json(small_tokenizer_dir, capsys):
    assert cli.main(["compile", str(catalog_path("metatool")), "--model", str(small_tokenizer_dir), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["tools"] == 199 and stats["fits_constant_memory"] is True and stats["max_pointer_tokens"] > 0


def test_cli_bad_input_exits_2_with_one_line(small_tokenizer_dir, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"name": "a"}, {"name": "a"}]')
    assert cli.main(["compile", str(bad), "--model", str(small_tokenizer_dir)]) == 2
    assert "duplicates tool #0" in capsys.readouterr().err
    assert cli.main(["compile", str(tmp_path / "missing.json"), "--model", str(small_tokenizer_dir)]) == 2


def test_cli_publish_versions_rollback(compiler, tmp_path, capsys):
    _, addr = compiler
    reg = tmp_path / "reg.json"
    reg.write_text(REGISTRY)
    assert cli.main(["--compiler", addr, "publish", str(reg), "--name", "demo"]) == 0
    reg.write_text(json.dumps([{"name": "maps"}]))
    assert cli.main(["--compiler", addr, "publish", str(reg), "--name", "demo"]) == 0
    assert cli.main(["--compiler", addr, "rollback", "demo", "1"]) == 0
    assert cli.main(["--compiler", addr, "versions", "demo", "--json"]) == 0
    out = capsys.readouterr().out
    versions = json.loads(out[out.index("["):])
    assert [(v["version"], v.get("latest", False)) for v in versions] == [(1, True), (2, False)]
    assert cli.main(["--compiler", addr, "rollback", "demo", "9"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err
    reg.write_text("[]")
    assert cli.main(["--compiler", addr, "publish", str(reg), "--name", "demo"]) == 2

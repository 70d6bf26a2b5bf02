"""Transport security (issue 29, finding 7): both servers with TLS (and mutual TLS), every client over TLS
(Python clients, CLI), and Redis over TLS with an ACL user, each against the real thing started that way
here (certificates from a throwaway CA made with openssl)."""
import asyncio
import dataclasses
import json
import uuid

import grpc
import pytest
import redis

from compiler_service.server import SERVICE, CompilerServicer, guard
from decoder_stack import TOOLS, DecoderStack, trie_of
from devstack.redis_server import LocalRedis, free_port
from shared.config import Settings
from shared.rpc import compiler_pb2 as pb, compiler_pb2_grpc as pb_grpc
from shared.serving import make_server, server_credentials, set_serving
from shared.store import CatalogStore
from shared.tokenizer import ModelTokenizer
from tls_fixtures import make_pki
from tooltrie import cli
from tooltrie.client import AsyncDecoderClient, DecoderClient, bearer, open_channel

REGISTRY = json.dumps([{"name": "weather", "description": "forecasts"}, {"name": "news"}])


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def server_settings(pki, mutual=False, **kw):
    return dataclasses.replace(Settings(), tls_cert=str(pki["server_crt"]), tls_key=str(pki["server_key"]),
                               tls_client_ca=str(pki["ca_crt"]) if mutual else "", **kw)


def client_settings(pki, who=None):
    extra = dict(tls_client_cert=str(pki[f"{who}_crt"]), tls_client_key=str(pki[f"{who}_key"])) if who else {}
    return dataclasses.replace(Settings(), tls=True, tls_ca=str(pki["ca_crt"]), **extra)


def start_compiler(settings, tokenizer_dir, redis_url):
    store = CatalogStore.from_url(redis_url, namespace=f"t-{uuid.uuid4().hex[:8]}")
    servicer = CompilerServicer(ModelTokenizer(tokenizer_dir), store, settings)
    addr = f"127.0.0.1:{free_port()}"
    server, health = make_server(addr, lambda s: pb_grpc.add_CompilerServiceServicer_to_server(servicer, s), [SERVICE],
                                 credentials=server_credentials(settings), interceptors=[guard(settings)],
                                 reflection_on=False)
    server.start()
    set_serving(health, [SERVICE], True)
    return server, addr


def test_compiler_over_tls_and_the_cli(pki, small_tokenizer_dir, redis_url, tmp_path, monkeypatch, capsys):
    server, addr = start_compiler(server_settings(pki), small_tokenizer_dir, redis_url)
    try:
        with grpc.insecure_channel(addr) as plain:   # a plaintext client gets nowhere
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.CompilerServiceStub(plain).ListCatalogs(pb.ListCatalogsRequest(), timeout=3)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with open_channel(addr, client_settings(pki)) as ch:
            stub = pb_grpc.CompilerServiceStub(ch)
            assert stub.Publish(pb.PublishRequest(name="tls", registry_json=REGISTRY), timeout=10).created
        (tmp_path / "r.json").write_text(REGISTRY)
        monkeypatch.setenv("TOOLTRIE_TLS_CA", str(pki["ca_crt"]))
        assert cli.main(["--compiler", addr, "versions", "tls"]) == 0
        assert "tls v1" in capsys.readouterr().out
    finally:
        server.stop(0)


def test_mutual_tls_and_the_certificate_identity_as_authorization(pki, small_tokenizer_dir, redis_url):
    """With a client CA the server admits only clients with a certificate it signed; with
    TOOLTRIE_PUBLISH_IDENTITIES the publisher's certificate authorizes Publish without a token, another
    certificate does not."""
    settings = server_settings(pki, mutual=True, publish_token="t0ken", publish_identities=["publisher"])
    server, addr = start_compiler(settings, small_tokenizer_dir, redis_url)
    try:
        with open_channel(addr, client_settings(pki)) as ch:   # no client certificate: the handshake fails
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.CompilerServiceStub(ch).ListCatalogs(pb.ListCatalogsRequest(), timeout=3)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with open_channel(addr, client_settings(pki, "client")) as ch:
            assert pb_grpc.CompilerServiceStub(ch).Publish(pb.PublishRequest(name="m", registry_json=REGISTRY),
                                                           timeout=10).created
        with open_channel(addr, client_settings(pki, "stranger")) as ch:
            stub = pb_grpc.CompilerServiceStub(ch)
            assert stub.ListVersions(pb.ListVersionsRequest(name="m"), timeout=10).versions
            with pytest.raises(grpc.RpcError) as err:
                stub.SetLatest(pb.SetLatestRequest(name="m", version=1), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert stub.SetLatest(pb.SetLatestRequest(name="m", version=1), timeout=10,
                                  metadata=bearer("t0ken")).version.latest
    finally:
        server.stop(0)


def test_decoder_over_tls_with_the_python_clients(pki, tmp_path, small_tokenizer_dir, redis_url):
    settings = server_settings(pki)
    s = DecoderStack(tmp_path, small_tokenizer_dir, redis_url, settings=settings,
                     credentials=server_credentials(settings))
    try:
        s.store.publish("demo", trie_of(s.tok, TOOLS[:10]))
        s.start()
        with DecoderClient(s.addr, settings=client_settings(pki)) as client:
            tools = list(client.discover("demo", "weather", k=2))
        assert len({t.name for t in tools}) == 2

        async def run():
            async with AsyncDecoderClient(s.addr, settings=client_settings(pki)) as client:   # `async with`
                return [t.name async for t in client.discover("demo", "weather", k=2)]
        assert asyncio.run(run()) == [t.name for t in tools]
        with DecoderClient(s.addr, settings=Settings(), timeout=3) as plain:
            with pytest.raises(grpc.RpcError):
                list(plain.discover("demo", "weather", k=2))
    finally:
        s.close()


def test_redis_over_tls_with_an_acl_user(pki, tmp_path, small_tokenizer_dir):
    tls = {"cert": pki["server_crt"], "key": pki["server_key"], "ca": pki["ca_crt"]}
    with LocalRedis(tmp_path / "redis", appendonly=False, tls=tls, users={"tooltrie": "pw-123"}) as server:
        assert server.url.startswith("rediss://tooltrie:pw-123@")
        store = CatalogStore.from_url(server.url, namespace="acl", ca_file=str(pki["ca_crt"]))
        info, created = store.publish("secure", trie_of(ModelTokenizer(small_tokenizer_dir), TOOLS[:4]))
        assert created and store.verified_blob("secure", 1)
        settings = dataclasses.replace(Settings(), redis_url=server.url, namespace="acl",
                                       redis_ca=str(pki["ca_crt"]))
        assert CatalogStore.from_settings(settings).latest_version("secure") == 1
        plain_port = server.url.replace("rediss://", "redis://")
        with pytest.raises(redis.ConnectionError):   # plaintext to the TLS port
            redis.Redis.from_url(plain_port, socket_timeout=2, socket_connect_timeout=2).ping()
        wrong = server.url.replace("pw-123", "wrong")
        with pytest.raises(redis.AuthenticationError):
            CatalogStore.from_url(wrong, ca_file=str(pki["ca_crt"])).r.ping()
        anonymous = f"rediss://127.0.0.1:{server.port}/0"   # the default user is off
        with pytest.raises(redis.AuthenticationError):
            CatalogStore.from_url(anonymous, ca_file=str(pki["ca_crt"])).r.get("x")

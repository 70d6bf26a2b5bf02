"""Deleting a catalog (issue 56, item 6), real Redis and real gRPC: the compiler's Delete (authorized like Publish)
removes every stored version in one transaction and announces it; the decoder stops serving the catalog (a request
in flight on it finishes first), a Discover on it is NOT_FOUND, and publishing the name again starts afresh."""
import dataclasses
import json
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2

from compiler_service.server import SERVICE, CompilerServicer, guard
from decoder_stack import TOOLS, DecoderStack, discover, failure, wait_until
from devstack.redis_server import free_port
from shared.config import Settings
from shared.rpc import compiler_pb2 as pb, compiler_pb2_grpc as pb_grpc, decoder_pb2
from shared.serving import make_server, set_serving
from shared.store import CatalogStore
from test_hot_swap import check
from test_reliability import hold_retrieval
from tooltrie import cli
from tooltrie.client import bearer

TOKEN = "pub-token-1"
GOOD = bearer(TOKEN)


@pytest.fixture
def stack(tmp_path, small_tokenizer_dir, redis_url):
    """A decoder and, on its Redis namespace, a compiler that wants the publish token."""
    s = DecoderStack(tmp_path, small_tokenizer_dir, redis_url, lease_seconds=3.0)
    settings = dataclasses.replace(Settings(), publish_token=TOKEN)
    servicer = CompilerServicer(s.tok, CatalogStore(s.store.r, s.ns), settings)
    addr = f"127.0.0.1:{free_port()}"
    server, health = make_server(addr, lambda g: pb_grpc.add_CompilerServiceServicer_to_server(servicer, g),
                                 [SERVICE], interceptors=[guard(settings)], reflection_on=False)
    server.start()
    set_serving(health, [SERVICE], True)
    channel = grpc.insecure_channel(addr)
    yield s, pb_grpc.CompilerServiceStub(channel), addr
    channel.close()
    server.stop(0)
    s.close()


def publish(compiler, name, tools):
    return compiler.Publish(pb.PublishRequest(name=name, registry_json=json.dumps(tools)), metadata=GOOD).version


def tooltrie(addr, *argv):
    return cli.main(["--compiler", addr, "--token", TOKEN, *argv])


def test_a_request_in_flight_finishes_then_the_deleted_catalog_is_not_found(stack, capsys):
    s, compiler, addr = stack
    publish(compiler, "gone", TOOLS[:12])
    publish(compiler, "kept", TOOLS[12:24])
    s.start()
    wait_until(lambda: {"gone", "kept"} <= set(s.catalogs.defaults()), 30, "both catalogs served")
    # the health follower publishes on its own beat: the deletion below must turn a published SERVING around
    wait_until(lambda: check(s.addr, "tooltrie.catalog.gone") == health_pb2.HealthCheckResponse.SERVING, 10,
               "the catalog SERVING")
    gate = threading.Event()
    try:
        hold_retrieval(s, gate, "held weather")
        first = s.stub().Discover(decoder_pb2.DiscoverRequest(catalog="gone", intent="held weather", k=2), timeout=60)
        wait_until(lambda: s.catalogs.version_states[("gone", 1)].requests == 1, 10, "the request in flight, on v1")
        assert tooltrie(addr, "delete", "gone") == 0
        assert capsys.readouterr().out.strip() == "deleted: gone (1 version)"
        wait_until(lambda: s.catalogs.default_version("gone") is None, 10, "the decoder to drop the catalog")
        err = failure(s.stub(), catalog="gone", intent="weather", k=1)
        assert err is not None and err.code() == grpc.StatusCode.NOT_FOUND, err
        wait_until(lambda: check(s.addr, "tooltrie.catalog.gone") == health_pb2.HealthCheckResponse.NOT_SERVING,
                   5, "the deleted catalog NOT_SERVING")
        assert ("gone", 1) in s.catalogs.loaded(), "released under its request"
        gate.set()
        events = list(first)
        assert events[0].accepted.version == 1 and events[-1].HasField("done") and len(events) == 4
        wait_until(lambda: ("gone", 1) not in s.catalogs.loaded(), 10, "v1 released once its request ended")
    finally:
        gate.set()
    assert discover(s.stub(), catalog="kept", intent="weather", k=2)[0].catalog == "kept"
    assert [v.name for v in compiler.ListCatalogs(pb.ListCatalogsRequest()).latest] == ["kept"]
    s.catalogs.refresh_leases()   # the decoder's lease on v1 goes with its last use
    assert s.store.r.keys(s.store._key("gone", "*")) == [s.store._key("gone", "counter").encode()]


def test_delete_needs_the_publish_token_and_a_known_catalog(stack, capsys):
    s, compiler, addr = stack
    publish(compiler, "mine", TOOLS[:5])
    for metadata in (None, bearer("pub-token-2")):
        with pytest.raises(grpc.RpcError) as err:
            compiler.Delete(pb.DeleteRequest(name="mine"), metadata=metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert cli.main(["--compiler", addr, "--token", "", "delete", "mine"]) == cli.EXIT_FAILED
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert compiler.GetCatalog(pb.GetCatalogRequest(name="mine")).version.version == 1   # still there
    assert tooltrie(addr, "delete", "never-published") == cli.EXIT_FAILED
    assert capsys.readouterr().err.strip() == "tooltrie: NOT_FOUND: no catalog named 'never-published'"
    assert tooltrie(addr, "delete", "bad name!") == cli.EXIT_BAD_INPUT
    with pytest.raises(grpc.RpcError) as err:
        compiler.Delete(pb.DeleteRequest(name="never-published"), metadata=GOOD)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_publishing_a_deleted_name_again_starts_a_fresh_catalog(stack):
    """Nothing of the old catalog comes back: no version to roll back to, no content-hash match (identical
    content is a new version, not `unchanged`); its numbers are not reused, so no decoder, lease or stored vectors
    can take the new v3 for an old one."""
    s, compiler, _ = stack
    publish(compiler, "again", TOOLS[:6])
    publish(compiler, "again", TOOLS[:7])
    s.start()
    wait_until(lambda: s.catalogs.default_version("again") == 2, 30, "v2 served")
    assert compiler.Delete(pb.DeleteRequest(name="again"), metadata=GOOD).versions == 2
    wait_until(lambda: s.catalogs.default_version("again") is None, 10, "the decoder to drop the catalog")
    reply = compiler.Publish(pb.PublishRequest(name="again", registry_json=json.dumps(TOOLS[:6])), metadata=GOOD)
    assert reply.created and reply.version.version == 3
    assert [v.version for v in compiler.ListVersions(pb.ListVersionsRequest(name="again")).versions] == [3]
    with pytest.raises(grpc.RpcError) as err:
        compiler.SetLatest(pb.SetLatestRequest(name="again", version=1), metadata=GOOD)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    wait_until(lambda: s.catalogs.default_version("again") == 3, 30, "the new catalog served")
    assert discover(s.stub(), catalog="again", intent="weather", k=2)[0].version == 3
    wait_until(lambda: check(s.addr, "tooltrie.catalog.again") == health_pb2.HealthCheckResponse.SERVING, 10,
               "its health SERVING (the follower's next pass)")


def test_a_delete_missed_while_disconnected_is_caught_up_on_reconnect(stack):
    """The reconciliation after an outage forgets a served catalog whose latest pointer is gone."""
    s, compiler, _ = stack
    publish(compiler, "missed", TOOLS[:5])
    s.start()
    s.store.r.delete(s.store._key("missed", "latest"))   # as if the delete's announcement never arrived
    s.catalogs.reconcile()
    assert s.catalogs.default_version("missed") is None and ("missed", 1) not in s.catalogs.loaded()
    assert failure(s.stub(), catalog="missed", intent="x", k=1).code() == grpc.StatusCode.NOT_FOUND


def test_a_delete_event_needs_a_catalog_name(stack):
    s, compiler, _ = stack
    publish(compiler, "safe", TOOLS[:5])
    s.start()
    for event in ({"event": "delete"}, {"name": "bad name!", "event": "delete"}, {"name": "safe", "event": "drop"}):
        s.catalogs._on_event(json.dumps(event))
    assert s.catalogs.defaults() == {"safe": 1}

"""Stored blobs are not trusted (issue 29, finding 2): the decoder verifies each version's blob against
what the compiler recorded (its digest, its HMAC when a signing key is set, the key it is stored under)
and then every array, and refuses a bad one with a log line and a metric; other catalogs, and the
catalog's version already served, are untouched. Real Redis, real gRPC."""
import json

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from decoder_stack import TOOLS, DecoderStack, discover, failure, trie_of, wait_until
from shared.store import BlobRejected, CatalogStore, blob_digest
from shared.tokenizer import ModelTokenizer
from shared.trie import Trie, TrieCorrupt


@pytest.fixture(scope="module")
def tok(small_tokenizer_dir):
    return ModelTokenizer(small_tokenizer_dir)


def tamper(store, name, version, change, fix_digest=False):
    """Rewrite a stored blob with change(trie) applied and announce it, as an attacker or a bad restore
    would; with fix_digest the info key's digest is recomputed too (someone who can write to Redis)."""
    trie = Trie.from_blob(store.blob(name, version))
    change(trie)
    blob = trie.to_blob()
    store.r.set(store._key(name, "blob", version), blob)
    if fix_digest:
        info = json.loads(store.r.get(store._key(name, "info", version)))
        info["blob_sha256"] = blob_digest(blob)
        store.r.set(store._key(name, "info", version), json.dumps(info))
    store.r.publish(store.channel, json.dumps({"name": name, "version": version, "event": "publish"}))
    return blob


def rotate_names(trie):
    trie.pointer_names = trie.pointer_names[1:] + trie.pointer_names[:1]


# --- the arrays ----------------------------------------------------------------------------------

CORRUPTIONS = {
    "token id past the vocabulary": lambda t: t.edge_token.__setitem__(0, 60000),
    "child out of range": lambda t: t.edge_child.__setitem__(int(np.flatnonzero(t.edge_child >= 0)[0]), 10**6),
    "child loops back to the root": lambda t: t.edge_child.__setitem__(int(np.flatnonzero(t.edge_child > 0)[-1]), 0),
    "offsets not monotonic": lambda t: t.node_edge_start.__setitem__(1, t.node_edge_start[2] + 1),
    "pointer range past the count": lambda t: t.edge_hi.__setitem__(0, len(t.pointer_names) + 5),
    "pointer range not nested": lambda t: t.edge_lo.__setitem__(
        int(np.flatnonzero(t.edge_child < 0)[0]), (int(t.edge_lo[np.flatnonzero(t.edge_child < 0)[0]]) + 7) % 30),
    "depth understated": lambda t: t.meta.__setitem__("max_pointer_tokens", 1),
    "a description missing": lambda t: t.meta["descriptions"].pop(),
    "an example not text": lambda t: t.meta["examples"].__setitem__(0, [3]),
    "an int64 array": lambda t: setattr(t, "edge_lo", t.edge_lo.astype(np.int64)),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_check_refuses_each_corruption(tok, corruption):
    trie = trie_of(tok, TOOLS)
    vocab = tok.tokenizer.get_vocab_size()
    trie.check(vocab)  # the compiler's own output passes
    CORRUPTIONS[corruption](trie)
    with pytest.raises(TrieCorrupt):
        trie.check(vocab)


def test_a_blob_as_stored_is_verified_against_its_info(redis_url, tok):
    store = CatalogStore.from_url(redis_url, namespace="t-verify-store")
    store.r.delete(*store.r.keys("t-verify-store:*") or ["x"])
    info, _ = store.publish("cat", trie_of(tok, TOOLS[:5]))
    assert info.blob_sha256 == blob_digest(store.blob("cat", 1)) and not info.signature
    assert store.verified_blob("cat", 1) == store.blob("cat", 1)
    blob = store.blob("cat", 1)
    store.r.set(store._key("cat", "blob", 1), blob[:-7])   # truncated
    with pytest.raises(BlobRejected, match="sha256"):
        store.verified_blob("cat", 1)
    # signed: a store with the key refuses a blob without a signature, or signed with another key
    signed = CatalogStore(store.r, store.ns, signing_key="k1")
    with pytest.raises(BlobRejected, match="not signed"):
        signed.verified_blob("cat", 1)
    signed.publish("cat", trie_of(tok, TOOLS[5:9]))
    assert signed.verified_blob("cat", 2)
    with pytest.raises(BlobRejected, match="signature"):
        CatalogStore(store.r, store.ns, signing_key="another").verified_blob("cat", 2)
    # a signed blob copied under another version's key (with its info) no longer matches its signature
    store.r.set(store._key("cat", "blob", 1), store.blob("cat", 2))
    info2 = json.loads(store.r.get(store._key("cat", "info", 2)))
    store.r.set(store._key("cat", "info", 1), json.dumps({**info2, "version": 1}))
    with pytest.raises(BlobRejected, match="signature"):
        signed.verified_blob("cat", 1)


# --- the decoder ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(tmp_path_factory, small_tokenizer_dir, redis_url):
    s = DecoderStack(tmp_path_factory.mktemp("tiny"), small_tokenizer_dir, redis_url)
    s.store.publish("good", trie_of(s.tok, TOOLS[:20]))
    s.store.publish("other", trie_of(s.tok, TOOLS[10:30]))
    s.start()
    wait_until(lambda: set(s.catalogs.defaults()) == {"good", "other"}, 30, "both catalogs")
    yield s
    s.close()


def health(stack, service):
    """The service's health status; SERVICE_UNKNOWN before the decoder has published one for it."""
    stub = health_pb2_grpc.HealthStub(stack.channel or grpc.insecure_channel(stack.addr))
    try:
        return stub.Check(health_pb2.HealthCheckRequest(service=service)).status
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.NOT_FOUND:
            raise
        return health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


def rejected(reason):
    return REGISTRY.get_sample_value("tooltrie_catalog_blobs_rejected_total", {"reason": reason}) or 0.0


@pytest.mark.parametrize("case, change, fix_digest, reason, message", [
    ("names rotated in the metadata", rotate_names, False, "digest", "sha256"),
    ("names rotated, digest recomputed", rotate_names, True, "arrays", "tokens spell"),
    ("token id out of range, digest recomputed", CORRUPTIONS["token id past the vocabulary"], True, "arrays",
     "outside the vocabulary"),
    ("child out of range, digest recomputed", CORRUPTIONS["child out of range"], True, "arrays", "child"),
])
def test_a_tampered_new_version_is_refused_and_the_served_one_keeps_serving(stack, case, change, fix_digest,
                                                                            reason, message):
    """A new version of 'good' whose stored blob was changed after publishing: refused (log line, metric),
    the catalog keeps answering from its served version with its own names, and 'other' is untouched."""
    store, stub = stack.store, stack.stub()
    served = stack.catalogs.default_version("good")
    before = rejected(reason)
    with pytest.MonkeyPatch.context() as mp:   # publish without announcing, then tamper and announce
        # the announcement goes to a channel nobody follows (publish sends it inside its MULTI)
        mp.setattr(type(store), "channel", property(lambda self: f"{self.ns}:nowhere"))
        info, _ = store.publish("good", trie_of(stack.tok, TOOLS[2:22] + [{"name": f"new_{len(case)}"}]))
    tamper(store, "good", info.version, change, fix_digest)
    wait_until(lambda: rejected(reason) > before, 20, "the refusal")
    assert stack.catalogs.default_version("good") == served
    accepted, pointers = discover(stub, catalog="good", intent="weather", k=3)
    assert accepted.version == served and {p.name for p in pointers} <= {t["name"] for t in TOOLS[:20]}
    err = failure(stub, catalog="good", version=info.version, intent="weather", k=1)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and message in err.details(), err.details()
    assert discover(stub, catalog="other", intent="news", k=2)[0].catalog == "other"
    assert health(stack, "tooltrie.catalog.good") == health_pb2.HealthCheckResponse.SERVING


def test_a_corrupt_catalog_is_refused_alone_and_accepted_names_the_key(stack, caplog):
    """A catalog whose only version is stored under v4 with v1's blob (digest recomputed): the version in
    the blob is not the key's, so it is refused; its health is NOT_SERVING; the decoder stays SERVING and
    serves the others."""
    store, stub = stack.store, stack.stub()
    with pytest.MonkeyPatch.context() as mp:
        # the announcements go to a channel nobody follows (publish sends them inside its MULTI)
        mp.setattr(type(store), "channel", property(lambda self: f"{self.ns}:nowhere"))
        for i in range(4):
            store.publish("moved", trie_of(stack.tok, TOOLS[i:i + 5]))
    store.r.set(store._key("moved", "blob", 4), store.blob("moved", 1))
    info = json.loads(store.r.get(store._key("moved", "info", 4)))
    moved = {**info, "blob_sha256": blob_digest(store.blob("moved", 1))}
    store.r.set(store._key("moved", "info", 4), json.dumps(moved))
    before = rejected("key")
    store.r.publish(store.channel, json.dumps({"name": "moved", "version": 4, "event": "publish"}))
    wait_until(lambda: rejected("key") > before, 20, "the refusal")
    assert "refused moved v4" in caplog.text and "says it is 'moved' v1" in caplog.text
    err = failure(stub, catalog="moved", intent="weather", k=1)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "failed verification" in err.details()
    wait_until(lambda: health(stack, "tooltrie.catalog.moved") == health_pb2.HealthCheckResponse.NOT_SERVING, 5,
               "the catalog's health")
    assert health(stack, "") == health_pb2.HealthCheckResponse.SERVING
    accepted, _ = discover(stub, catalog="moved", version=3, intent="weather", k=1)   # an intact version
    assert accepted.version == 3
    assert discover(stub, catalog="other", intent="news", k=2)[0].catalog == "other"


def test_a_signed_store_refuses_unsigned_blobs(tmp_path, small_tokenizer_dir, redis_url):
    """With TOOLTRIE_SIGNING_KEY, the decoder serves what a compiler with the same key published and refuses
    a version written without it (a blob put into Redis by anyone else)."""
    s = DecoderStack(tmp_path, small_tokenizer_dir, redis_url, signing_key="s3cret")
    try:
        compiler = CatalogStore(s.store.r, s.ns, signing_key="s3cret")
        compiler.publish("signed", trie_of(s.tok, TOOLS[:6]))
        CatalogStore(s.store.r, s.ns).publish("forged", trie_of(s.tok, TOOLS[6:12]))
        s.start()
        wait_until(lambda: "forged" in s.catalogs.catalog_states and s.catalogs.catalog_states["forged"].refused, 20,
                   "the forged catalog refused")
        assert s.catalogs.defaults() == {"signed": 1}
        assert "not signed" in failure(s.stub(), catalog="forged", intent="x", k=1).details()
    finally:
        s.close()

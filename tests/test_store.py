"""The versioned catalog store against a real redis-server."""
import json
import threading
import uuid

import pytest
import redis

from compiler_service.compiler import compile_catalog
from shared.catalog import registry_from_entries
from shared.store import CatalogStore, NotFound
from shared.tokenizer import ModelTokenizer
from shared.trie import Trie


@pytest.fixture(scope="module")
def tok(small_tokenizer_dir):
    return ModelTokenizer(small_tokenizer_dir)


@pytest.fixture
def store(redis_url):
    return CatalogStore.from_url(redis_url, namespace=f"t-{uuid.uuid4().hex[:8]}", keep_versions=3)


def trie_of(tok, *names):
    return compile_catalog(registry_from_entries([{"name": n, "description": f"does {n}"} for n in names]), tok)


def test_publish_versions_and_latest(store, tok):
    v1, created1 = store.publish("cat", trie_of(tok, "a", "b"))
    v2, created2 = store.publish("cat", trie_of(tok, "a", "b", "c"))
    assert (v1.version, created1, v2.version, created2) == (1, True, 2, True)
    assert store.latest_version("cat") == 2 and store.info("cat").latest
    assert [v.version for v in store.list_versions("cat")] == [1, 2]
    back = Trie.from_blob(store.blob("cat", 1))
    assert sorted(back.pointer_names) == ["a", "b"] and back.meta["name"] == "cat" and back.meta["version"] == 1


def test_identical_content_returns_the_existing_version(store, tok):
    store.publish("cat", trie_of(tok, "a"))
    store.publish("cat", trie_of(tok, "b"))
    again, created = store.publish("cat", trie_of(tok, "a"))
    assert (again.version, created) == (1, False)
    assert store.latest_version("cat") == 1  # publishing it again makes it the catalog again


def test_rollback_and_its_event(store, tok, redis_url):
    sub = redis.Redis.from_url(redis_url).pubsub()
    sub.subscribe(store.channel)
    assert sub.get_message(timeout=2)["type"] == "subscribe"
    store.publish("cat", trie_of(tok, "a"))
    store.publish("cat", trie_of(tok, "b"))
    assert store.set_latest("cat", 1).latest
    events = [json.loads(sub.get_message(timeout=2)["data"]) for _ in range(3)]
    assert events == [{"name": "cat", "version": 1, "event": "publish"},
                      {"name": "cat", "version": 2, "event": "publish"},
                      {"name": "cat", "version": 1, "event": "rollback"}]
    assert store.latest_version("cat") == 1


def test_missing_catalogs_and_versions(store, tok):
    with pytest.raises(NotFound, match="no catalog named 'nope'"):
        store.latest_version("nope")
    with pytest.raises(NotFound):
        store.list_versions("nope")
    store.publish("cat", trie_of(tok, "a"))
    with pytest.raises(NotFound, match="has no version 7"):
        store.set_latest("cat", 7)
    with pytest.raises(NotFound, match="has no version 7"):
        store.blob("cat", 7)


def test_concurrent_publishers_never_share_a_version(store, tok):
    tries = [trie_of(tok, f"tool{i}") for i in range(12)]
    results = []
    threads = [threading.Thread(target=lambda t=t: results.append(store.publish("cat", t)[0].version))
               for t in tries]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(1, 13))
    latest = store.latest_version("cat")
    assert Trie.from_blob(store.blob("cat", latest)).meta["version"] == latest


def test_retention_keeps_the_newest_versions(store, tok):
    for i in range(5):
        store.publish("cat", trie_of(tok, f"t{i}"))
    assert [v.version for v in store.list_versions("cat")] == [3, 4, 5]
    with pytest.raises(NotFound):
        store.blob("cat", 2)


def test_trimming_never_drops_the_version_latest_names(store, tok):
    """A rollback racing a publish can leave latest on an old version when the trim runs."""
    for i in range(3):
        store.publish("cat", trie_of(tok, f"t{i}"))
    store.set_latest("cat", 1)
    strict = CatalogStore(store.r, store.ns, keep_versions=1)
    strict._trim("cat")
    assert [v.version for v in store.list_versions("cat")] == [1, 3]


def test_keys_are_namespaced(store, tok, redis_url):
    store.publish("cat", trie_of(tok, "a"))
    keys = redis.Redis.from_url(redis_url).keys(f"{store.ns}:*")
    assert keys and all(k.decode().startswith(store.ns + ":") for k in keys)


def test_catalog_listing(store, tok):
    store.publish("one", trie_of(tok, "a"))
    store.publish("two", trie_of(tok, "b"))
    store.publish("two", trie_of(tok, "c"))
    assert [(i.name, i.version, i.latest) for i in store.list_catalogs()] == [("one", 1, True), ("two", 2, True)]

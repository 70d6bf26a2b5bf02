"""Catalog versions as the decoder serves them: loaded from Redis, warmed, hot-swapped, released.

A new version (announced on the store's channel, or found by reconciling with the store's `latest`
pointers after a reconnect) is loaded and its prefix warmed in the background; only then does it
become the default for new requests. A request pins one version for its whole life; a version that
is no longer the default is released when its last request ends. If Redis goes away, loaded versions
keep serving and the subscriber reconnects with backoff.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter

import redis
from prometheus_client import Counter as MetricCounter, Gauge

from decoder_service.engine.catalog_runtime import CatalogRuntime
from decoder_service.engine.engine import DecodeEngine, RequestError, TokenizerMismatch
from decoder_service.retrieval import Retriever, bm25_index, computed_vectors, vectors_from_blob
from shared.store import CatalogStore, NotFound
from shared.trie import Trie

log = logging.getLogger("tooltrie.catalogs")
VERSIONS_LOADED = Gauge("tooltrie_catalog_versions_loaded", "Catalog versions held by the decoder")
SWAPS = MetricCounter("tooltrie_catalog_swaps_total", "Times a catalog's default version changed")
REFUSED = MetricCounter("tooltrie_catalog_refused_total", "Catalog versions refused (e.g. tokenizer mismatch)")
VECTORS = MetricCounter("tooltrie_tool_vectors_total", "Catalog versions' tool vectors, by where they came from",
                        ["source"])


class CatalogRefused(Exception):
    """The catalog's wanted version cannot be served here (FAILED_PRECONDITION): another tokenizer,
    or a prompt prefix longer than the model's context."""


class CatalogManager:
    def __init__(self, store: CatalogStore, engine: DecodeEngine, names: list[str] | None = None,
                 warm_timeout: float = 600.0, encoder=None):
        self.store, self.engine, self.names, self.warm_timeout = store, engine, names, warm_timeout
        self.encoder = encoder
        self.loaded: dict[tuple[str, int], CatalogRuntime] = {}
        self.latest: dict[str, int] = {}
        self.wanted: dict[str, int] = {}  # the newest announced default per catalog, in event order
        self.refused: dict[str, str] = {}  # catalog -> why its wanted version is not served
        self.active: Counter = Counter()
        self._lock = threading.Lock()
        self._loading: dict[tuple[str, int], threading.Event] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- requests ------------------------------------------------------------------------------
    def acquire(self, name: str, version: int = 0) -> CatalogRuntime:
        """The version a request pins (the default when 0), loaded on demand; release() it after."""
        with self._lock:
            if not version:
                if name not in self.latest:
                    if name in self.refused:
                        raise CatalogRefused(self.refused[name])
                    raise NotFound(f"no catalog named {name!r} is loaded")
                version = self.latest[name]
            rt = self.loaded.get((name, version))
            if rt is not None:
                self.active[(name, version)] += 1
                return rt
        rt = self.load(name, version)  # an explicit older version still in the store
        with self._lock:
            self.active[(name, version)] += 1
        return rt

    def release(self, rt: CatalogRuntime) -> None:
        with self._lock:
            self.active[rt.key] -= 1
            self._retire_if_unused(rt.key)

    def _retire_if_unused(self, key) -> None:
        name, version = key
        if self.active[key] <= 0 and self.latest.get(name) != version and key in self.loaded:
            rt = self.loaded.pop(key)
            del self.active[key]
            self.engine.release_catalog(rt)
            VERSIONS_LOADED.set(len(self.loaded))
            log.info("released %s v%d", name, version)

    def ready(self) -> bool:
        return any(rt.ready.is_set() for rt in self.loaded.values())

    # --- loading -------------------------------------------------------------------------------
    def load(self, name: str, version: int) -> CatalogRuntime:
        """Fetch, check and warm one version (once, however many callers ask at the same time)."""
        key = (name, version)
        with self._lock:
            if key in self.loaded:
                return self.loaded[key]
            pending = self._loading.get(key)
            if pending is None:
                self._loading[key] = threading.Event()
        if pending is not None:
            pending.wait(self.warm_timeout)
            if key not in self.loaded:
                raise NotFound(f"catalog {name!r} v{version} could not be loaded")
            return self.loaded[key]
        try:
            trie = Trie.from_blob(self.store.blob(name, version))
            try:
                rt = self.engine.load_catalog(trie, self.retriever(name, version, trie))
            except (TokenizerMismatch, RequestError) as e:  # another tokenizer; a prefix past the context
                REFUSED.inc()
                with self._lock:
                    self.refused[name] = str(e)
                raise CatalogRefused(str(e)) from e
            if not rt.ready.wait(self.warm_timeout):
                raise TimeoutError(f"catalog {name!r} v{version} did not warm within {self.warm_timeout:.0f} s")
            with self._lock:
                self.loaded[key] = rt
                VERSIONS_LOADED.set(len(self.loaded))
            log.info("loaded %s v%d: %d tools, %d prefix tokens warm in %.2f s", name, version,
                     len(trie.pointer_names), len(rt.prefix_ids), rt.warm_seconds)
            return rt
        finally:
            with self._lock:
                self._loading.pop(key).set()

    def retriever(self, name: str, version: int, trie: Trie) -> Retriever:
        """The version's retriever: its BM25 index from the blob, its tool vectors from the store, or
        computed (once per version and encoder) and stored for the next start or replica."""
        index, n = bm25_index(trie), len(trie.pointer_names)
        if self.encoder is None:
            return Retriever(index, n)
        digest = self.encoder.digest
        vectors = None
        try:
            blob = self.store.vectors(name, version, digest)
            if blob is not None:
                vectors = vectors_from_blob(blob, trie, digest, self.encoder.dim)
                VECTORS.labels("store").inc()
        except (redis.ConnectionError, redis.TimeoutError, ValueError) as e:
            log.warning("%s v%d: stored tool vectors not used (%s); computing them", name, version, e)
        if vectors is None:
            started = time.perf_counter()
            vectors, blob = computed_vectors(trie, self.encoder)
            VECTORS.labels("computed").inc()
            log.info("%s v%d: %d tool vectors computed in %.2f s", name, version, n, time.perf_counter() - started)
            try:
                self.store.put_vectors(name, version, digest, blob)
            except (redis.ConnectionError, redis.TimeoutError) as e:
                log.warning("%s v%d: tool vectors not stored (%s)", name, version, e)
        return Retriever(index, n, vectors, self.encoder)

    def announce(self, name: str, version: int) -> None:
        """Record version as the wanted default and load it in the background (events arrive in order;
        loads may finish out of order, so only the newest announcement becomes the default)."""
        with self._lock:
            self.wanted[name] = version
        threading.Thread(target=self.make_default, args=(name, version), daemon=True).start()

    def make_default(self, name: str, version: int) -> None:
        """Load (if needed) and make version the default for new requests; retire the old default."""
        with self._lock:
            self.wanted.setdefault(name, version)
        try:
            self.load(name, version)
        except (NotFound, CatalogRefused, TimeoutError) as e:
            log.error("not serving %s v%d: %s", name, version, e)
            return
        with self._lock:
            old = self.latest.get(name)
            if old == version or self.wanted.get(name) != version:
                self._retire_if_unused((name, version))  # superseded while it was loading
                return
            self.latest[name] = version
            self.refused.pop(name, None)
            SWAPS.inc()
            log.info("default of %s is now v%d (was v%s)", name, version, old)
            if old is not None:
                self._retire_if_unused((name, old))

    def reconcile(self) -> None:
        """Bring every catalog's default in line with the store's latest pointer (after a start or an
        outage, so an announcement missed while disconnected is not lost)."""
        names = self.names or [i.name for i in self.store.list_catalogs()]
        for name in names:
            try:
                version = self.store.latest_version(name)
            except NotFound:
                log.warning("catalog %s is not in the store", name)
                continue
            if self.latest.get(name) != version:
                with self._lock:
                    self.wanted[name] = version
                self.make_default(name, version)

    # --- the subscriber ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._follow, name="tooltrie-catalogs", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _follow(self) -> None:
        backoff = 0.2
        while not self._stop.is_set():
            try:
                pubsub = self.store.r.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self.store.channel)
                self.reconcile()  # after subscribing, so nothing published in between is missed
                backoff = 0.2
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=1.0)
                    if message and message["type"] == "message":
                        event = json.loads(message["data"])
                        if self.names is None or event["name"] in self.names:
                            self.announce(event["name"], int(event["version"]))
            except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
                log.warning("redis unavailable (%s); serving loaded versions, retrying in %.1f s", e, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            except Exception:  # noqa: BLE001 - the follower must outlive any one bad event
                log.exception("catalog follower failed; restarting")
                self._stop.wait(1.0)

    def describe(self) -> list[dict]:
        with self._lock:
            return [{**rt.describe(), "latest": self.latest.get(name) == version,
                     "active_requests": self.active[(name, version)]}
                    for (name, version), rt in sorted(self.loaded.items())]

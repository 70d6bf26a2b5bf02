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
import os
import socket
import threading
import time
import uuid
from collections import Counter

import redis
from prometheus_client import Counter as MetricCounter, Gauge

from decoder_service.engine.catalog_runtime import CatalogRuntime
from decoder_service.engine.engine import DecodeEngine, RequestError, TokenizerMismatch
from decoder_service.retrieval import Retriever, bm25_index, computed_vectors, vectors_digest, vectors_from_blob
from shared.catalog import CatalogError, check_catalog_name, clip, shown
from shared.store import BlobRejected, CatalogStore, NotFound
from shared.trie import Trie, TrieCorrupt

log = logging.getLogger("tooltrie.catalogs")
VERSIONS_LOADED = Gauge("tooltrie_catalog_versions_loaded", "Catalog versions held by the decoder")
SWAPS = MetricCounter("tooltrie_catalog_swaps_total", "Times a catalog's default version changed")
REFUSED = MetricCounter("tooltrie_catalog_refused_total", "Catalog versions refused (e.g. tokenizer mismatch)")
BLOBS_REJECTED = MetricCounter("tooltrie_catalog_blobs_rejected_total", "Stored catalog blobs refused by "
                               "verification (digest, signature, key or arrays), by reason", ["reason"])
SUPERSEDED = MetricCounter("tooltrie_catalog_loads_superseded_total", "Loads of a version abandoned because a "
                           "newer one was announced")
EVENTS_DROPPED = MetricCounter("tooltrie_catalog_events_dropped_total", "Messages on the events channel that name "
                               "no catalog version, or that the store contradicts (malformed or forged), dropped")
VECTORS = MetricCounter("tooltrie_tool_vectors_total", "Catalog versions' tool vectors, by where they came from",
                        ["source"])


SMALLER_FIRST_S = 10.0   # the longest one stage of a version's load waits for a smaller version's load
GIVE_WAY = 3.0           # after a stage of a load, it waits while requests are in flight up to this times the stage


class CatalogRefused(Exception):
    """The catalog's wanted version cannot be served here (FAILED_PRECONDITION): another tokenizer,
    a prompt prefix longer than the model's context, or a stored blob that failed verification."""


class Superseded(Exception):
    """A newer version was announced while this one was loading: the load was abandoned."""


class CatalogLoading(Exception):
    """The catalog is in the store and its first version is still loading (UNAVAILABLE, saying how far: its
    health service name `tooltrie.catalog.<name>` turns SERVING once it is served)."""


def verify_trie(name: str, version: int, blob: bytes, vocab_size: int, tokenizer=None, between=None) -> Trie:
    """A stored blob as a trie the engine may use, or BlobRejected: it must parse, name the key it is
    stored under (the version a request is told comes from the key, never from the blob), pass
    Trie.check, spell each tool's name with its tokens (when the tokenizer is given; a blob whose names
    were rotated would answer with wrong names) and carry a well-formed BM25 index. between(seconds the
    check took), when given, is called after each check (a huge blob's checks take seconds of the GIL)."""
    started = time.perf_counter()

    def checked() -> None:
        nonlocal started
        if between is not None:
            between(time.perf_counter() - started)
        started = time.perf_counter()
    try:
        trie = Trie.from_blob(blob)
    except Exception as e:  # noqa: BLE001 - whatever a damaged blob raises, it is refused
        raise BlobRejected(f"catalog {name!r} v{version}: the blob cannot be read ({type(e).__name__}: "
                           f"{str(e)[:200]})", "unreadable") from None
    if trie.meta.get("name") != name or trie.meta.get("version") != version:
        raise BlobRejected(f"catalog {name!r} v{version}: the blob says it is {str(trie.meta.get('name'))[:80]!r} "
                           f"v{str(trie.meta.get('version'))[:20]}", "key")
    checked()
    try:
        trie.check(vocab_size)
        checked()
        bm25_index(trie)
    except (TrieCorrupt, ValueError, KeyError, TypeError) as e:
        raise BlobRejected(f"catalog {name!r} v{version}: {str(e)[:300]}", "arrays") from None
    checked()
    if tokenizer is not None:
        spelled = tokenizer.decode_batch(trie.spelled(), skip_special_tokens=False)
        wrong = next((i for i, (a, b) in enumerate(zip(spelled, trie.pointer_names)) if a != b), None)
        if wrong is not None:
            raise BlobRejected(f"catalog {name!r} v{version}: tool #{wrong}'s tokens spell {spelled[wrong][:80]!r}, "
                               f"its name is {trie.pointer_names[wrong][:80]!r}", "arrays")
    return trie


class CatalogManager:
    def __init__(self, store: CatalogStore, engine: DecodeEngine, names: list[str] | None = None,
                 warm_timeout: float = 600.0, encoder=None, lease_seconds: float = 60.0):
        self.store, self.engine, self.names, self.warm_timeout = store, engine, names, warm_timeout
        self.encoder = encoder
        self.lease_seconds = lease_seconds
        self.holder = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._leased: set[tuple[str, int]] = set()
        self._workers: set[str] = set()   # catalogs whose default is being brought to the wanted version
        self.started = threading.Event()  # set once the first pass over the store has finished
        self.loaded: dict[tuple[str, int], CatalogRuntime] = {}
        self.latest: dict[str, int] = {}
        self.wanted: dict[str, int] = {}  # the newest announced default per catalog, in event order
        self.refused: dict[str, str] = {}  # catalog -> why its wanted version is not served
        self.refused_versions: dict[tuple[str, int], str] = {}  # versions whose blob failed verification
        self.deleted: set[str] = set()   # catalogs deleted from the store: NOT_SERVING until published again
        self.active: Counter = Counter()
        self._lock = threading.Lock()
        self._loading: dict[tuple[str, int], threading.Event] = {}
        self._tools: dict[tuple[str, int], int] = {}   # a loading version's tools, once its blob is read
        self._changed = threading.Condition(self._lock)   # a load ended, or the last request in flight did
        self._stage: dict[tuple[str, int], str] = {}   # how far a version's load is, for a caller who asks for it
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
                    if name in self.wanted:
                        key = (name, self.wanted[name])
                        raise CatalogLoading(f"catalog {name!r} v{key[1]} is loading "
                                             f"({self._stage.get(key, 'queued')}); retry shortly")
                    if not self.started.is_set():
                        raise CatalogLoading("the decoder is still reading the store's catalogs; retry shortly")
                    raise NotFound(f"no catalog named {name!r:.80} is loaded")
                version = self.latest[name]
            rt = self.loaded.get((name, version))
            if rt is not None:
                self.active[(name, version)] += 1
                return rt
        rt = self.load(name, version)  # an explicit older version still in the store
        with self._lock:
            if not self.active[(name, version)] and self.latest.get(name) != version:
                self.engine.make_resident(rt, constant=False)   # first pinned: resident before its request
            self.active[(name, version)] += 1
        return rt

    def release(self, rt: CatalogRuntime) -> None:
        with self._lock:
            self.active[rt.key] -= 1
            self._retire_if_unused(rt.key)
            if not self._requests_in_flight():
                self._changed.notify_all()

    def _requests_in_flight(self) -> bool:
        return any(n > 0 for n in self.active.values())

    def _retire_if_unused(self, key) -> None:
        name, version = key
        if self.active[key] <= 0 and self.latest.get(name) != version and key in self.loaded:
            rt = self.loaded.pop(key)
            del self.active[key]
            self.engine.release_catalog(rt)
            VERSIONS_LOADED.set(len(self.loaded))
            log.info("released %s v%d", name, version)

    def ready(self) -> bool:
        """Overall readiness (the decoder's health policy): the first pass over the store is done (every
        catalog found is loading on its own worker, or served, or refused) and at least one catalog has a
        default version. A catalog that is slow to load, refused or corrupt holds no other back; per
        catalog, see catalog_health()."""
        with self._lock:
            return self.started.is_set() and bool(self.latest)

    def settled(self) -> bool:
        """Whether every catalog found has its newest announced version served, or is refused (nothing is
        loading)."""
        with self._lock:
            return self.started.is_set() and not self._workers and all(
                self.latest.get(n) == v or n in self.refused for n, v in self.wanted.items())

    def catalog_health(self) -> dict[str, bool]:
        """Per catalog the decoder knows of: whether it has a ready default version (True) or not yet /
        not at all (False: loading, or refused)."""
        with self._lock:
            names = set(self.latest) | set(self.wanted) | set(self.refused) | self.deleted
            return {n: n in self.latest for n in names}

    # --- loading -------------------------------------------------------------------------------
    def load(self, name: str, version: int, superseded=None) -> CatalogRuntime:
        """Fetch, verify and warm one version (once, however many callers ask at the same time).
        superseded() is asked between the stages of a default's load: when it says so, the load is
        abandoned (Superseded) for the newer version."""
        key = (name, version)
        while True:
            with self._lock:
                if key in self.loaded:
                    return self.loaded[key]
                pending = self._loading.get(key)
                if pending is None:
                    self._loading[key] = threading.Event()
                    break
            if not pending.wait(self.warm_timeout):
                raise TimeoutError(f"catalog {name!r} v{version} did not load within {self.warm_timeout:.0f} s")
            with self._lock:
                if key in self.loaded:
                    return self.loaded[key]
                if key in self.refused_versions:
                    raise CatalogRefused(self.refused_versions[key])
            # the other caller's load failed or was superseded: try it ourselves
        try:
            self._lease_now(name, version)
            self._set_stage(key, "fetching its blob")
            self._give_way(key, 0.0, self._tools_of(name, version))
            trie = self._fetch_verified(name, version, lambda worked: self._give_way(key, worked))
            if superseded and superseded():
                raise Superseded(f"{name} v{version}")
            try:
                retriever = self.retriever(name, version, trie, superseded)
                self._set_stage(key, "warming its prompt prefix")
                rt = self.engine.load_catalog(trie, retriever)
            except (TokenizerMismatch, RequestError) as e:  # another tokenizer; a prefix past the context
                REFUSED.inc()
                with self._lock:
                    self.refused[name] = str(e)
                raise CatalogRefused(str(e)) from e
            if not rt.ready.wait(self.warm_timeout):
                raise TimeoutError(f"catalog {name!r} v{version} did not warm within {self.warm_timeout:.0f} s")
            if superseded and superseded():
                self.engine.release_catalog(rt)
                raise Superseded(f"{name} v{version}")
            with self._lock:
                self.loaded[key] = rt
                VERSIONS_LOADED.set(len(self.loaded))
            log.info("loaded %s v%d: %d tools, %d prefix tokens warm in %.2f s, fusion weight %g", name, version,
                     len(trie.pointer_names), len(rt.prefix_ids), rt.warm_seconds, rt.fusion_weight)
            return rt
        finally:
            with self._lock:
                self._loading.pop(key).set()
                self._stage.pop(key, None)
                self._tools.pop(key, None)
                self._changed.notify_all()

    def _tools_of(self, name: str, version: int) -> int:
        """A version's tool count as its info record says (0 where that cannot be read: the blob's check decides)."""
        try:
            return int(self.store.info(name, version).stats.get("tools", 0))
        except (NotFound, redis.ConnectionError, redis.TimeoutError, ValueError, TypeError):
            return 0

    def _give_way(self, key: tuple[str, int], worked: float, tools: int | None = None) -> None:
        """Between two stages of a load (its blob's checks, each slice of its vectors): wait (up to SMALLER_FIRST_S)
        while a version with fewer tools is loading or announced (tools: this one's, recorded first), then while
        requests are in flight, up to GIVE_WAY times as long as the stage just done took (`worked`, seconds). A
        catalog of a few tools is served in seconds, and its requests answered, instead of sharing the cores and
        the GIL with a huge one's checks and vectors; under steady traffic a load still runs a quarter of the
        time."""
        def smaller_loading() -> bool:
            mine = self._tools.get(key, 0)
            return any(n < mine for other, n in self._tools.items() if other != key)
        with self._lock:
            if tools is not None:
                self._tools[key] = tools
            self._changed.wait_for(lambda: not smaller_loading() or self._stop.is_set(), SMALLER_FIRST_S)
            self._changed.wait_for(lambda: not self._requests_in_flight() or self._stop.is_set(),
                                   GIVE_WAY * worked)

    def _set_stage(self, key: tuple[str, int], stage: str) -> None:
        with self._lock:
            self._stage[key] = stage

    def _fetch_verified(self, name: str, version: int, between) -> Trie:
        """The stored blob of one version, verified (BlobRejected -> CatalogRefused, logged and counted);
        between(seconds the step took) is called after the fetch and after each of verify_trie's checks."""
        tok = self.engine.tok
        vocab = tok.tokenizer.get_vocab_size(with_added_tokens=True)
        model_vocab = getattr(getattr(self.engine.backend, "cfg", None), "vocab_size", None)
        if isinstance(model_vocab, int):
            vocab = min(vocab, model_vocab)
        try:
            started = time.perf_counter()
            blob = self.store.verified_blob(name, version)
            between(time.perf_counter() - started)
            return verify_trie(name, version, blob, vocab, tok.tokenizer, between)
        except BlobRejected as e:
            BLOBS_REJECTED.labels(e.reason).inc()
            log.error("refused %s v%d: %s", name, version, e)
            message = f"catalog {name!r} v{version} is refused: its stored blob failed verification ({e})"
            with self._lock:
                self.refused[name] = message
                self.refused_versions[(name, version)] = message
            raise CatalogRefused(message) from None
        except NotFound:
            raise
        except (ValueError, TypeError, KeyError) as e:  # an info record that is not one (damaged in Redis)
            BLOBS_REJECTED.labels("info").inc()
            log.error("refused %s v%d: its info record is damaged (%s)", name, version, e)
            raise CatalogRefused(f"catalog {name!r} v{version} is refused: its info record is damaged") from None

    # --- leases: the store never trims a version this decoder holds -----------------------------
    def held_versions(self) -> set[tuple[str, int]]:
        with self._lock:
            return set(self.loaded) | set(self._loading) | {k for k, n in self.active.items() if n > 0}

    def _lease_now(self, name: str, version: int) -> None:
        try:
            self.store.lease(name, [version], self.holder, self.lease_seconds)
            with self._lock:
                self._leased.add((name, version))
        except (redis.ConnectionError, redis.TimeoutError) as e:
            log.warning("could not lease %s v%d (%s)", name, version, e)

    def refresh_leases(self) -> None:
        """Renew the leases on every version held (loaded, loading or pinned) and drop the others'."""
        held = self.held_versions()
        by_name: dict[str, list[int]] = {}
        for name, version in held:
            by_name.setdefault(name, []).append(version)
        for name, versions in by_name.items():
            self.store.lease(name, versions, self.holder, self.lease_seconds)
        for name, version in self._leased - held:
            self.store.unlease(name, version, self.holder)
        self._leased = held

    def _lease_loop(self) -> None:
        while not self._stop.wait(self.lease_seconds / 3):
            try:
                self.refresh_leases()
            except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
                log.warning("leases not refreshed (%s)", e)

    def retriever(self, name: str, version: int, trie: Trie, superseded=None) -> Retriever:
        """The version's retriever: its BM25 index from the blob, its tool vectors from the store, or
        computed (once per version and encoder) and stored for the next start or replica; a computation that
        superseded() ends is abandoned at its next slice (Superseded)."""
        index, n = bm25_index(trie), len(trie.pointer_names)
        if self.encoder is None:
            return Retriever(index, n)
        digest = vectors_digest(self.encoder)
        vectors = None
        try:
            blob = self.store.vectors(name, version, digest)
            if blob is not None:
                vectors = vectors_from_blob(blob, trie, digest, self.encoder.dim)
                VECTORS.labels("store").inc()
        except (redis.ConnectionError, redis.TimeoutError, ValueError) as e:
            if isinstance(e, BlobRejected):
                BLOBS_REJECTED.labels(e.reason).inc()
            log.warning("%s v%d: stored tool vectors not used (%s); computing them", name, version, e)
        if vectors is None:
            sliced = time.perf_counter()

            def progress(done: int, total: int) -> None:
                nonlocal sliced
                self._set_stage((name, version), f"{100 * done // total}% of its {total} texts' vectors")
                if superseded and superseded():
                    raise Superseded(f"{name} v{version}")
                self._give_way((name, version), time.perf_counter() - sliced)
                sliced = time.perf_counter()
            self._set_stage((name, version), "computing its tool vectors")
            started = time.perf_counter()
            vectors, blob = computed_vectors(trie, self.encoder, progress)
            VECTORS.labels("computed").inc()
            log.info("%s v%d: %d tool vectors computed in %.2f s", name, version, n, time.perf_counter() - started)
            try:
                self.store.put_vectors(name, version, digest, blob)
            except (redis.ConnectionError, redis.TimeoutError) as e:
                log.warning("%s v%d: tool vectors not stored (%s)", name, version, e)
        return Retriever(index, n, vectors, self.encoder)

    def announce(self, name: str, version: int, tools: int | None = None) -> None:
        """Record version as the wanted default and bring the catalog to it in the background: one worker
        per catalog, which always loads the newest announced version; a load in progress that a newer
        announcement supersedes is abandoned at its next stage instead of being finished and queued. tools (the
        version's tool count, when the caller read it) is recorded before the worker starts, so that a larger
        version announced beside it waits for it from the first instant (_give_way)."""
        with self._lock:
            self.wanted[name] = version
            self.deleted.discard(name)
            for key in [k for k in self._tools if k[0] == name and k not in self._loading]:
                del self._tools[key]   # queued for an older announcement of this catalog: not loading
            if tools is not None:
                self._tools[(name, version)] = tools
            if name in self._workers:
                return
            self._workers.add(name)
        threading.Thread(target=self._default_worker, args=(name,), daemon=True,
                         name=f"tooltrie-default-{name}").start()

    def _default_worker(self, name: str) -> None:
        try:
            while True:
                with self._lock:
                    version = self.wanted[name]
                self.make_default(name, version)
                with self._lock:
                    if self.wanted.get(name, version) == version:   # absent: the catalog was deleted
                        self._workers.discard(name)
                        return
        except BaseException:
            with self._lock:
                self._workers.discard(name)
            raise

    def make_default(self, name: str, version: int) -> None:
        """Load (if needed) and make version the default for new requests; retire the old default. Any
        failure of this catalog's load is logged and leaves every other catalog untouched."""
        with self._lock:
            self.wanted.setdefault(name, version)
        try:
            rt = self.load(name, version, superseded=lambda: self.wanted.get(name, version) != version)
        except Superseded:
            SUPERSEDED.inc()
            log.info("%s v%d superseded by v%s while loading", name, version, self.wanted.get(name))
            return
        except (NotFound, CatalogRefused, TimeoutError) as e:
            log.error("not serving %s v%d: %s", name, version, e)
            return
        except Exception:  # one catalog's failure must not stop the others
            log.exception("not serving %s v%d", name, version)
            with self._lock:
                self.refused.setdefault(name, f"catalog {name!r} v{version} could not be loaded")
            return
        with self._lock:
            old = self.latest.get(name)
            if old == version or self.wanted.get(name) != version:
                self._retire_if_unused((name, version))  # superseded while it was loading
                return
            self.engine.make_resident(rt)   # bound before any request that sees the new default is queued
            self.latest[name] = version
            self.refused.pop(name, None)
            SWAPS.inc()
            log.info("default of %s is now v%d (was v%s)", name, version, old)
            if old is not None:
                self._retire_if_unused((name, old))

    def forget(self, name: str) -> None:
        """Drop a catalog deleted from the store: no longer a default (a Discover on it is NOT_FOUND), nor
        loading; each of its versions is released when its last request ends."""
        with self._lock:
            for table in (self.latest, self.wanted, self.refused):
                table.pop(name, None)
            self.refused_versions = {k: v for k, v in self.refused_versions.items() if k[0] != name}
            self.deleted.add(name)
            for key in [k for k in self._tools if k[0] == name and k not in self._loading]:
                del self._tools[key]
            for key in [k for k in self.loaded if k[0] == name]:
                self._retire_if_unused(key)
        log.info("catalog %s deleted: no longer served", name)

    def reconcile(self) -> None:
        """Bring every catalog's default in line with the store's latest pointer (after a start or an
        outage, so an announcement missed while disconnected is not lost, a deletion included). Each catalog
        loads on its own worker (announce), the smallest first: a slow one holds no other back."""
        with self._lock:
            known = set(self.latest) | set(self.wanted)
        stale = []
        for name in sorted(set(self.names or self.store.catalog_names()) | known):
            try:
                version = self.store.latest_version(name)
            except NotFound:
                if name in known:
                    self.forget(name)
                else:
                    log.warning("catalog %s is not in the store", name)
                continue
            except ValueError as e:  # a damaged latest pointer: this catalog only
                log.error("catalog %s: its latest pointer is damaged (%s)", name, e)
                continue
            if self.latest.get(name) != version:
                stale.append((self._tools_of(name, version), name, version))
        for tools, name, version in sorted(stale):
            self.announce(name, version, tools)

    # --- the subscriber ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._follow, name="tooltrie-catalogs", daemon=True)
        self._thread.start()
        threading.Thread(target=self._lease_loop, name="tooltrie-leases", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _follow(self) -> None:
        backoff = 0.2
        while not self._stop.is_set():
            try:
                pubsub = self.store.r.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self.store.channel)
                self.refresh_leases()  # before anything is published again after an outage
                self.reconcile()  # after subscribing, so nothing published in between is missed
                self.started.set()
                backoff = 0.2
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=1.0)
                    if message and message["type"] == "message":
                        self._on_event(message["data"])
            except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
                log.warning("redis unavailable (%s); serving loaded versions, retrying in %.1f s", e, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            except Exception:  # the follower must outlive any one bad event
                log.exception("catalog follower failed; restarting")
                self._stop.wait(1.0)

    def _on_event(self, data) -> None:
        """Announce the version an event names when it is the catalog's latest in the store, or forget a deleted
        catalog; an event that is not `{"name": a catalog name, "version": a positive int}` or `{"name": a catalog
        name, "event": "delete"}`, or whose claim the store contradicts (a version it does not hold, a deletion of a
        catalog still there: a forgery, or damage), is counted, logged clipped, and dropped. Publish, rollback and
        delete write the store and announce in one transaction, so a true event's claim holds when it is read."""
        try:
            event = json.loads(data)
            if not isinstance(event, dict):
                raise ValueError("not an object")
            name, version = check_catalog_name(event.get("name")), event.get("version")
            deleted = event.get("event") == "delete" and version is None
            if not deleted and (not isinstance(version, int) or isinstance(version, bool) or not 0 < version < 2**31):
                raise ValueError(f"version {shown(version)} is not a positive integer")
        except (ValueError, CatalogError) as e:   # json's errors are ValueErrors
            EVENTS_DROPPED.inc()
            log.warning("dropped an event that is not a catalog version (%s): %s", clip(str(e), 200),
                        shown(data, 200))
            return
        if self.names is not None and name not in self.names:
            return
        try:
            latest = self.store.latest_version(name)
        except NotFound:
            latest = None
        if deleted and latest is not None:
            forged = f"catalog {name!r} is still in the store"
        elif not deleted and not self.store.has_version(name, version):
            forged = f"catalog {name!r} has no version {version} in the store"
        else:
            forged = ""
        if forged:
            EVENTS_DROPPED.inc()
            log.warning("dropped an event the store contradicts (%s): %s", forged, shown(data, 200))
        elif deleted:
            self.forget(name)
        elif latest == version:
            self.announce(name, version)
        # else another version was made the latest (or the catalog deleted) since: its own event follows

    def describe(self) -> list[dict]:
        with self._lock:
            return [{**rt.describe(), "latest": self.latest.get(name) == version,
                     "active_requests": self.active[(name, version)]}
                    for (name, version), rt in sorted(self.loaded.items())]

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
from dataclasses import dataclass

import redis
from prometheus_client import Counter as MetricCounter, Gauge

from decoder_service.engine.catalog_runtime import CatalogRuntime
from decoder_service.engine.engine import DecodeEngine, RequestError, TokenizerMismatch
from decoder_service.retrieval.host import Retriever, bm25_index
from decoder_service.retrieval.vectors import ToolVectorCache
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


@dataclass(eq=False)
class VersionState:
    """One catalog version in this decoder, from the moment it is announced or asked for until it is released: how
    far its load is, what the load made (the runtime: its trie, its retriever with the tool vectors, its warm prompt
    prefix), why its blob was refused, and the requests that pin it. Read and written under the manager's lock."""
    name: str
    version: int
    tools: int | None = None          # its tool count as its info record says (smaller versions load first)
    queued: bool = False              # announced as its catalog's default, its load not begun
    stage: str = "queued"             # how far its load is, for a caller who asks
    load_ended: threading.Event | None = None   # while a load of it is under way: set when that load ends
    runtime: CatalogRuntime | None = None       # once loaded
    refused: str = ""                 # why its stored blob failed verification
    requests: int = 0                 # requests that pin it

    @property
    def key(self) -> tuple[str, int]:
        return self.name, self.version

    @property
    def pending(self) -> bool:
        """Announced or loading: a larger version's load gives way to it."""
        return self.queued or self.load_ended is not None

    @property
    def held(self) -> bool:
        """Loaded, loading or pinned: leased in the store, never trimmed."""
        return self.runtime is not None or self.load_ended is not None or self.requests > 0


@dataclass(eq=False)
class CatalogState:
    """One catalog in this decoder: the version new requests get, the newest one announced, why it is not served."""
    name: str
    default: int | None = None        # the version new requests get, once one is loaded
    wanted: int | None = None         # the newest announced default, in event order
    refused: str = ""                 # why its wanted version is not served
    deleted: bool = False             # deleted from the store: NOT_SERVING until published again
    worker: bool = False              # a worker is bringing its default to the wanted version


class CatalogManager:
    """The catalogs and versions this decoder serves, one CatalogState and one VersionState each, under one lock."""

    def __init__(self, store: CatalogStore, engine: DecodeEngine, names: list[str] | None = None,
                 warm_timeout: float = 600.0, encoder=None, lease_seconds: float = 60.0):
        self.store, self.engine, self.names, self.warm_timeout = store, engine, names, warm_timeout
        self.encoder = encoder
        self.vector_cache = (ToolVectorCache(store, encoder, lambda reason: BLOBS_REJECTED.labels(reason).inc())
                             if encoder is not None else None)
        self.lease_seconds = lease_seconds
        self.holder = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.catalog_states: dict[str, CatalogState] = {}
        self.version_states: dict[tuple[str, int], VersionState] = {}
        self.started = threading.Event()  # set once the first pass over the store has finished
        self._leased: set[tuple[str, int]] = set()   # the versions this decoder's leases in the store name
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)   # a load ended, or the last request in flight did
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _catalog(self, name: str) -> CatalogState:
        return self.catalog_states.setdefault(name, CatalogState(name))

    def _version(self, name: str, version: int) -> VersionState:
        return self.version_states.setdefault((name, version), VersionState(name, version))

    def _default_of(self, name: str) -> int | None:
        catalog = self.catalog_states.get(name)
        return catalog.default if catalog else None

    def _drop_if_idle(self, state: VersionState) -> None:
        """Forget a version that holds nothing any more (not loaded, loading, pinned, announced nor refused)."""
        if not (state.held or state.queued or state.refused):
            self.version_states.pop(state.key, None)

    # --- what the decoder serves -----------------------------------------------------------------
    def default_version(self, name: str) -> int | None:
        with self._lock:
            return self._default_of(name)

    def defaults(self) -> dict[str, int]:
        """Each served catalog's default version."""
        with self._lock:
            return {n: c.default for n, c in self.catalog_states.items() if c.default is not None}

    def loaded(self) -> set[tuple[str, int]]:
        with self._lock:
            return {k for k, v in self.version_states.items() if v.runtime is not None}

    def stage(self, name: str, version: int) -> str:
        """How far a version's load is ("queued" when none is under way)."""
        with self._lock:
            state = self.version_states.get((name, version))
            return state.stage if state else "queued"

    # --- requests ------------------------------------------------------------------------------
    def acquire(self, name: str, version: int = 0) -> CatalogRuntime:
        """The version a request pins (the default when 0), loaded on demand; release() it after."""
        with self._lock:
            if not version:
                catalog = self.catalog_states.get(name, CatalogState(name))
                if catalog.default is None:
                    if catalog.refused:
                        raise CatalogRefused(catalog.refused)
                    if catalog.wanted is not None:
                        wanted = self.version_states.get((name, catalog.wanted))
                        raise CatalogLoading(f"catalog {name!r} v{catalog.wanted} is loading "
                                             f"({wanted.stage if wanted else 'queued'}); retry shortly")
                    if not self.started.is_set():
                        raise CatalogLoading("the decoder is still reading the store's catalogs; retry shortly")
                    raise NotFound(f"no catalog named {name!r:.80} is loaded")
                version = catalog.default
            state = self.version_states.get((name, version))
            if state is not None and state.runtime is not None:
                state.requests += 1
                return state.runtime
        rt = self.load(name, version)  # an explicit older version still in the store
        with self._lock:
            state = self._version(name, version)
            if not state.requests and self._default_of(name) != version:
                self.engine.make_resident(rt, constant=False)   # first pinned: resident before its request
            state.requests += 1
        return rt

    def release(self, rt: CatalogRuntime) -> None:
        with self._lock:
            state = self.version_states[rt.key]
            state.requests -= 1
            self._retire_if_unused(state)
            if not self._requests_in_flight():
                self._changed.notify_all()

    def _requests_in_flight(self) -> bool:
        return any(v.requests > 0 for v in self.version_states.values())

    def _retire_if_unused(self, state: VersionState | None) -> None:
        """Release a loaded version no request pins that is not its catalog's default."""
        if state is None:
            return
        if state.requests <= 0 and state.runtime is not None and self._default_of(state.name) != state.version:
            rt, state.runtime = state.runtime, None
            self.engine.release_catalog(rt)
            self._drop_if_idle(state)
            VERSIONS_LOADED.set(sum(v.runtime is not None for v in self.version_states.values()))
            log.info("released %s v%d", state.name, state.version)

    def ready(self) -> bool:
        """Overall readiness (the decoder's health policy): the first pass over the store is done (every
        catalog found is loading on its own worker, or served, or refused) and at least one catalog has a
        default version. A catalog that is slow to load, refused or corrupt holds no other back; per
        catalog, see catalog_health()."""
        with self._lock:
            return self.started.is_set() and any(c.default is not None for c in self.catalog_states.values())

    def settled(self) -> bool:
        """Whether every catalog found has its newest announced version served, or is refused (nothing is
        loading)."""
        with self._lock:
            return self.started.is_set() and not any(c.worker for c in self.catalog_states.values()) and all(
                c.default == c.wanted or c.refused for c in self.catalog_states.values() if c.wanted is not None)

    def catalog_health(self) -> dict[str, bool]:
        """Per catalog the decoder knows of: whether it has a ready default version (True) or not yet /
        not at all (False: loading, refused or deleted)."""
        with self._lock:
            return {n: c.default is not None for n, c in self.catalog_states.items()}

    # --- loading -------------------------------------------------------------------------------
    def load(self, name: str, version: int, superseded=None) -> CatalogRuntime:
        """Fetch, verify and warm one version (once, however many callers ask at the same time).
        superseded() is asked between the stages of a default's load: when it says so, the load is
        abandoned (Superseded) for the newer version."""
        while True:
            with self._lock:
                state = self._version(name, version)
                if state.runtime is not None:
                    return state.runtime
                pending = state.load_ended
                if pending is None:
                    state.load_ended, state.queued = threading.Event(), False
                    break
            if not pending.wait(self.warm_timeout):
                raise TimeoutError(f"catalog {name!r} v{version} did not load within {self.warm_timeout:.0f} s")
            with self._lock:
                if state.runtime is not None:
                    return state.runtime
                if state.refused:
                    raise CatalogRefused(state.refused)
            # the other caller's load failed or was superseded: try it ourselves
        try:
            self._lease_now(name, version)
            self._set_stage(state, "fetching its blob")
            self._give_way(state, 0.0, self._tools_of(name, version))
            trie = self._fetch_verified(state, lambda worked: self._give_way(state, worked))
            if superseded and superseded():
                raise Superseded(f"{name} v{version}")
            try:
                retriever = self.retriever(name, version, trie, superseded)
                self._set_stage(state, "warming its prompt prefix")
                rt = self.engine.load_catalog(trie, retriever)
            except (TokenizerMismatch, RequestError) as e:  # another tokenizer; a prefix past the context
                REFUSED.inc()
                with self._lock:
                    self._catalog(name).refused = str(e)
                raise CatalogRefused(str(e)) from e
            if not rt.ready.wait(self.warm_timeout):
                raise TimeoutError(f"catalog {name!r} v{version} did not warm within {self.warm_timeout:.0f} s")
            if superseded and superseded():
                self.engine.release_catalog(rt)
                raise Superseded(f"{name} v{version}")
            with self._lock:
                state.runtime = rt
                VERSIONS_LOADED.set(sum(v.runtime is not None for v in self.version_states.values()))
            log.info("loaded %s v%d: %d tools, %d prefix tokens warm in %.2f s, fusion weight %g", name, version,
                     len(trie.pointer_names), len(rt.prefix_ids), rt.warm_seconds, rt.fusion_weight)
            return rt
        finally:
            with self._lock:
                state.load_ended.set()
                state.load_ended, state.stage = None, "queued"
                self._drop_if_idle(state)
                self._changed.notify_all()

    def _tools_of(self, name: str, version: int) -> int:
        """A version's tool count as its info record says (0 where that cannot be read: the blob's check decides)."""
        try:
            return int(self.store.info(name, version).stats.get("tools", 0))
        except (NotFound, redis.ConnectionError, redis.TimeoutError, ValueError, TypeError):
            return 0

    def _give_way(self, state: VersionState, worked: float, tools: int | None = None) -> None:
        """Between two stages of a load (its blob's checks, each slice of its vectors): wait (up to SMALLER_FIRST_S)
        while another catalog's version with fewer tools is loading or announced (tools: this one's, recorded first;
        a version whose count is not known yet holds nothing back), then while
        requests are in flight, up to GIVE_WAY times as long as the stage just done took (`worked`, seconds). A
        catalog of a few tools is served in seconds, and its requests answered, instead of sharing the cores and
        the GIL with a huge one's checks and vectors; under steady traffic a load still runs a quarter of the
        time."""
        def smaller_pending() -> bool:
            mine = state.tools or 0
            return any(other.pending and other.tools is not None and other.tools < mine
                       for other in self.version_states.values() if other.name != state.name)
        with self._lock:
            if tools is not None:
                state.tools = tools
            self._changed.wait_for(lambda: not smaller_pending() or self._stop.is_set(), SMALLER_FIRST_S)
            self._changed.wait_for(lambda: not self._requests_in_flight() or self._stop.is_set(),
                                   GIVE_WAY * worked)

    def _set_stage(self, state: VersionState, stage: str) -> None:
        with self._lock:
            state.stage = stage

    def _fetch_verified(self, state: VersionState, between) -> Trie:
        """The stored blob of one version, verified (BlobRejected -> CatalogRefused, logged and counted);
        between(seconds the step took) is called after the fetch and after each of verify_trie's checks."""
        name, version = state.key
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
                self._catalog(name).refused = state.refused = message
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
            return {k for k, v in self.version_states.items() if v.held}

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
        """The version's retriever: its BM25 index from the blob, its tool vectors from the store or computed (and
        stored: ToolVectorCache); a computation that superseded() ends is abandoned at its next slice (Superseded)."""
        index, n = bm25_index(trie), len(trie.pointer_names)
        if self.vector_cache is None:
            return Retriever(index, n)
        vectors = self.vector_cache.stored(name, version, trie)
        if vectors is None:
            with self._lock:   # a version this manager is not loading (a caller of its own) reports to no one
                state = self.version_states.get((name, version)) or VersionState(name, version)
            sliced = time.perf_counter()

            def progress(done: int, total: int) -> None:
                nonlocal sliced
                self._set_stage(state, f"{100 * done // total}% of its {total} texts' vectors")
                if superseded and superseded():
                    raise Superseded(f"{name} v{version}")
                self._give_way(state, time.perf_counter() - sliced)
                sliced = time.perf_counter()
            self._set_stage(state, "computing its tool vectors")
            vectors = self.vector_cache.computed(name, version, trie, progress)
        return Retriever(index, n, vectors, self.encoder)

    def announce(self, name: str, version: int, tools: int | None = None) -> None:
        """Record version as the wanted default and bring the catalog to it in the background: one worker
        per catalog, which always loads the newest announced version; a load in progress that a newer
        announcement supersedes is abandoned at its next stage instead of being finished and queued. tools (the
        version's tool count, when the caller read it) is recorded before the worker starts, so that a larger
        version announced beside it waits for it from the first instant (_give_way)."""
        with self._lock:
            catalog = self._catalog(name)
            catalog.wanted, catalog.deleted = version, False
            for state in [v for v in self.version_states.values() if v.name == name and v.queued]:
                state.queued = False          # queued for an older announcement of this catalog: not loading
                self._drop_if_idle(state)
            state = self._version(name, version)
            if state.runtime is None and state.load_ended is None:
                state.queued = True
            if tools is not None:
                state.tools = tools
            if catalog.worker:
                return
            catalog.worker = True
        threading.Thread(target=self._default_worker, args=(name,), daemon=True,
                         name=f"tooltrie-default-{name}").start()

    def _default_worker(self, name: str) -> None:
        catalog = self.catalog_states[name]
        try:
            while True:
                with self._lock:
                    version = catalog.wanted
                self.make_default(name, version)
                with self._lock:
                    if catalog.wanted in (None, version):   # None: the catalog was deleted
                        catalog.worker = False
                        return
        except BaseException:
            with self._lock:
                catalog.worker = False
            raise

    def make_default(self, name: str, version: int) -> None:
        """Load (if needed) and make version the default for new requests; retire the old default. Any
        failure of this catalog's load is logged and leaves every other catalog untouched."""
        with self._lock:
            catalog = self._catalog(name)
            if catalog.wanted is None:
                catalog.wanted = version
        try:
            rt = self.load(name, version, superseded=lambda: catalog.wanted not in (None, version))
        except Superseded:
            SUPERSEDED.inc()
            log.info("%s v%d superseded by v%s while loading", name, version, catalog.wanted)
            return
        except (NotFound, CatalogRefused, TimeoutError) as e:
            log.error("not serving %s v%d: %s", name, version, e)
            return
        except Exception:  # one catalog's failure must not stop the others
            log.exception("not serving %s v%d", name, version)
            with self._lock:
                catalog.refused = catalog.refused or f"catalog {name!r} v{version} could not be loaded"
            return
        with self._lock:
            old = catalog.default
            if old == version or catalog.wanted != version:
                self._retire_if_unused(self.version_states.get((name, version)))  # superseded while it was loading
                return
            self.engine.make_resident(rt)   # bound before any request that sees the new default is queued
            catalog.default, catalog.refused = version, ""
            SWAPS.inc()
            log.info("default of %s is now v%d (was v%s)", name, version, old)
            if old is not None:
                self._retire_if_unused(self.version_states.get((name, old)))

    def forget(self, name: str) -> None:
        """Drop a catalog deleted from the store: no longer a default (a Discover on it is NOT_FOUND), nor
        loading; each of its versions is released when its last request ends."""
        with self._lock:
            catalog = self._catalog(name)
            catalog.default = catalog.wanted = None
            catalog.refused, catalog.deleted = "", True
            for state in [v for v in self.version_states.values() if v.name == name]:
                state.queued, state.refused = False, ""
                self._retire_if_unused(state)
                self._drop_if_idle(state)
        log.info("catalog %s deleted: no longer served", name)

    def reconcile(self) -> None:
        """Bring every catalog's default in line with the store's latest pointer (after a start or an
        outage, so an announcement missed while disconnected is not lost, a deletion included). Each catalog
        loads on its own worker (announce), the smallest first: a slow one holds no other back."""
        with self._lock:
            known = {n for n, c in self.catalog_states.items() if c.default is not None or c.wanted is not None}
            defaults = {n: c.default for n, c in self.catalog_states.items()}
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
            if defaults.get(name) != version:
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
            return [{**v.runtime.describe(), "latest": self._default_of(v.name) == v.version,
                     "active_requests": v.requests}
                    for _, v in sorted(self.version_states.items()) if v.runtime is not None]

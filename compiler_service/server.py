"""The compiler service: Compile, Publish, ListCatalogs, ListVersions, GetCatalog, SetLatest, Delete, Feedback,
Learn over gRPC.

`python -m compiler_service.server` listens on TOOLTRIE_COMPILER_ADDR, stores tries in REDIS_URL.
"""
from __future__ import annotations

import json
import logging
import threading

from prometheus_client import Histogram

from compiler_service.compiler import compile_catalog
from compiler_service.learn import check_feedback, check_tools, learned_registry
from shared.catalog import check_catalog_name, parse_registry
from shared.config import Settings
from shared.feedback import FeedbackStore
from shared.rpc import compiler_pb2 as pb, compiler_pb2_grpc as pb_grpc
from shared.serving import (AddressInUse, Busy, Credentials, Guard, Rule, follow_redis, make_server, rpc,
                            server_credentials, setup_logging, start_metrics, wait_for_termination)
from shared.store import CatalogStore, LatestMoved, VersionInfo
from shared.tokenizer import ModelTokenizer
from shared.trie import Trie, read_blob_metadata

log = logging.getLogger("tooltrie.compiler")
SERVICE = pb.DESCRIPTOR.services_by_name["CompilerService"].full_name
COMPILE_SECONDS = Histogram("tooltrie_compile_seconds", "Time to compile one registry into a trie")
COMPILES_AT_ONCE = 1    # registries compiled at the same time (Compile and Publish): bounds the compiler's memory
COMPILE_WAIT_S = 60.0   # the longest a call waits for its turn to compile
LEARN_ATTEMPTS = 3      # Learns redone on the new latest when a version is published meanwhile, before ABORTED


def version_message(info: VersionInfo) -> pb.CatalogVersion:
    s = info.stats
    return pb.CatalogVersion(
        name=info.name, version=info.version, content_hash=info.content_hash,
        tokenizer_hash=info.tokenizer_hash, created_unix=info.created_unix, latest=info.latest,
        stats=pb.TrieStats(**{f: s[f] for f in pb.TrieStats.DESCRIPTOR.fields_by_name if f in s}))


class CompilerServicer(pb_grpc.CompilerServiceServicer):
    def __init__(self, tokenizer: ModelTokenizer, store: CatalogStore, settings: Settings):
        self.tok, self.store, self.settings = tokenizer, store, settings
        self._compiling = threading.BoundedSemaphore(COMPILES_AT_ONCE)
        self.feedback = FeedbackStore(store)
        self._names: dict[tuple[str, int], list[str]] = {}   # tool names of the versions feedback named lately
        self._names_lock = threading.Lock()

    def _compile(self, registry_json: str, context):
        """The registry compiled, COMPILES_AT_ONCE at a time (a registry of 100,000 tools takes about 0.5 GB while it
        compiles): a call that cannot start within half its time left (at most COMPILE_WAIT_S; the other half is
        for the compile and the answer) is refused as Busy."""
        wait = min((context.time_remaining() or 2 * COMPILE_WAIT_S) / 2, COMPILE_WAIT_S)
        if not self._compiling.acquire(timeout=max(wait, 0.0)):
            raise Busy(f"the compiler is busy with other registries; retry later (waited {wait:.0f} s)")
        try:
            with COMPILE_SECONDS.time():
                return compile_catalog(parse_registry(registry_json, self.settings), self.tok)
        finally:
            self._compiling.release()

    @rpc(SERVICE)
    def Compile(self, request, context):
        trie = self._compile(request.registry_json, context)
        stats = {**trie.stats(), "compile_ms": trie.meta["compile_ms"],
                 "prompt_prefix_chars": len(trie.meta["prompt"])}
        return pb.CompileResponse(stats=pb.TrieStats(**stats))

    @rpc(SERVICE)
    def Publish(self, request, context):
        name = check_catalog_name(request.name)
        info, created = self.store.publish(name, self._compile(request.registry_json, context))
        log.info("published %s v%d (created=%s)", name, info.version, created)
        return pb.PublishResponse(version=version_message(info), created=created)

    @rpc(SERVICE)
    def ListCatalogs(self, request, context):
        return pb.ListCatalogsResponse(latest=[version_message(i) for i in self.store.list_catalogs()])

    @rpc(SERVICE)
    def ListVersions(self, request, context):
        return pb.ListVersionsResponse(versions=[version_message(i) for i in self.store.list_versions(request.name)])

    @rpc(SERVICE)
    def GetCatalog(self, request, context):
        blob = self.store.blob(request.name, request.version)
        names = json.loads(read_blob_metadata(blob)["pointer_names"])
        info = self.store.info(request.name, request.version)
        return pb.GetCatalogResponse(version=version_message(info), tool_names=names,
                                     blob=blob if request.include_blob else b"")

    @rpc(SERVICE)
    def SetLatest(self, request, context):
        info = self.store.set_latest(request.name, request.version)
        log.info("latest of %s is now v%d", request.name, info.version)
        return pb.SetLatestResponse(version=version_message(info))

    @rpc(SERVICE)
    def Delete(self, request, context):
        versions = self.store.delete(request.name)
        log.info("deleted %s (%d versions)", request.name, versions)
        return pb.DeleteResponse(versions=versions)

    def _tool_names(self, name: str, version: int) -> list[str]:
        """A stored version's tool names (NotFound for one that is not stored); a version never changes and its
        number is never reused, so the names of the last few asked for are kept rather than read again."""
        self.store.info(name, version)
        with self._names_lock:
            names = self._names.get((name, version))
        if names is None:
            names = json.loads(read_blob_metadata(self.store.blob(name, version))["pointer_names"])
            with self._names_lock:
                if len(self._names) >= 16:
                    self._names.pop(next(iter(self._names)))
                self._names[(name, version)] = names
        return names

    @rpc(SERVICE)
    def Feedback(self, request, context):
        check_feedback(request, self.tok, self.settings.max_name_chars)
        check_tools(request.tools, self._tool_names(request.name, request.version), request.name, request.version)
        self.feedback.record(request.name, request.intent, list(request.tools))
        return pb.FeedbackResponse()

    @rpc(SERVICE)
    def Learn(self, request, context):
        """The latest version published again with the feedback its tools were chosen for alone as examples. The
        publish is a compare-and-set on the version learned from: a version published meanwhile (another Learn's,
        or a registry's) is learned from again, LEARN_ATTEMPTS times at most (then ABORTED), so no version's
        examples or tools are published over."""
        name = request.name
        for _ in range(LEARN_ATTEMPTS):
            latest = self.store.latest_version(name)
            trie = Trie.from_blob(self.store.verified_blob(name, latest))
            registry, added = learned_registry(trie, self.feedback.alone(name, trie.pointer_names),
                                               self.settings.max_examples)
            if not added:
                return pb.LearnResponse(version=version_message(self.store.info(name, latest)), created=False)
            learned = self._compile(json.dumps(registry, ensure_ascii=False), context)
            try:
                info, created = self.store.publish(name, learned, on_latest=latest)
            except LatestMoved:
                log.info("learning %s: v%d is no longer the latest; learning from the new one", name, latest)
                continue
            log.info("learned %s v%d from v%d: %d examples added", name, info.version, latest, added)
            return pb.LearnResponse(version=version_message(info), created=created, examples_added=added)
        raise LatestMoved(f"catalog {name!r} changed while learning, {LEARN_ATTEMPTS} times; learn again")


def _name(request) -> None:
    check_catalog_name(request.name)


def _version(request) -> None:
    check_catalog_name(request.name)
    if request.version < 1:
        raise ValueError(f"version must be at least 1, got {request.version}")


def guard(settings: Settings) -> Guard:
    """Compile, Publish, SetLatest, Delete, Feedback, Learn and blob reads (GetCatalog with include_blob) need the
    publish credentials (TOOLTRIE_PUBLISH_TOKEN and/or TOOLTRIE_PUBLISH_IDENTITIES) when any are set (a compile
    costs as much as a publish; feedback becomes examples); names are checked before anything touches Redis."""
    creds = Credentials([settings.publish_token], settings.publish_identities)
    method = f"/{SERVICE}/"
    return Guard({method + "Compile": Rule(None, creds),
                  method + "Publish": Rule(_name, creds),
                  method + "SetLatest": Rule(_version, creds),
                  method + "Delete": Rule(_name, creds),
                  method + "Feedback": Rule(_name, creds),
                  method + "Learn": Rule(_name, creds),
                  method + "GetCatalog": Rule(_name, creds, protected=lambda r: r.include_blob),
                  method + "ListVersions": Rule(_name)})


def serve(settings: Settings | None = None) -> None:
    settings = settings or Settings()
    if not settings.redis_url:
        raise SystemExit("REDIS_URL is not set: point it at a Redis (`make run` starts one for you)")
    tokenizer = ModelTokenizer(settings.model_dir)
    store = CatalogStore.from_settings(settings)
    servicer = CompilerServicer(tokenizer, store, settings)
    credentials = server_credentials(settings)
    server, health = make_server(settings.compiler_addr,
                                 lambda s: pb_grpc.add_CompilerServiceServicer_to_server(servicer, s), [SERVICE],
                                 credentials=credentials, reflection_on=settings.reflection,
                                 interceptors=[guard(settings)])
    start_metrics(settings.metrics_port, settings.metrics_host)
    server.start()
    if not (settings.publish_token or settings.publish_identities):
        log.warning("publishing is open to every caller: set TOOLTRIE_PUBLISH_TOKEN (docs/deploy.md)")
    stop = threading.Event()   # health follows Redis: NOT_SERVING while it is unreachable
    threading.Thread(target=follow_redis, args=(store.r.ping, health, [SERVICE], stop), daemon=True).start()
    log.info("compiler listening on %s (%s; model %s)", settings.compiler_addr, "TLS" if credentials else "plaintext",
             settings.model_dir)
    wait_for_termination(server, health, [SERVICE], grace=settings.drain_seconds, before_stop=stop.set)


if __name__ == "__main__":
    setup_logging()
    try:
        serve()
    except AddressInUse as e:
        raise SystemExit(f"compiler: {e}") from None

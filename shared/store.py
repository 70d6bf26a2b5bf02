"""The versioned catalog store in Redis.

Per catalog name, versions 1, 2, 3, ... Publishing writes the blob, its info, the content-hash index
and the `latest` pointer and announces `{name, version}` on the event channel in one MULTI/EXEC,
guarded by WATCH on the version counter: no reader sees `latest` name a missing blob, and two
concurrent publishers never get the same version. All keys live under the namespace.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

import redis

from shared.trie import Trie


class NotFound(KeyError):
    """No such catalog, or no such version of it."""

    def __str__(self) -> str:
        return self.args[0]


@dataclass(frozen=True)
class VersionInfo:
    name: str
    version: int
    content_hash: str
    tokenizer_hash: str
    created_unix: float
    stats: dict
    latest: bool = False


class CatalogStore:
    def __init__(self, client: redis.Redis, namespace: str = "tooltrie", keep_versions: int = 10):
        self.r = client
        self.ns = namespace
        self.keep_versions = max(1, keep_versions)

    @classmethod
    def from_url(cls, url: str, namespace: str = "tooltrie", keep_versions: int = 10) -> "CatalogStore":
        return cls(redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2,
                                        health_check_interval=10), namespace, keep_versions)

    # --- keys ------------------------------------------------------------------------------
    @property
    def channel(self) -> str:
        return f"{self.ns}:events"

    def _key(self, name: str, *parts) -> str:
        return ":".join([self.ns, "cat", name, *map(str, parts)])

    # --- writes ----------------------------------------------------------------------------
    def publish(self, name: str, trie: Trie) -> tuple[VersionInfo, bool]:
        """Store trie as the next version of name and make it latest; identical content returns
        (and makes latest) the version that already holds it. Returns (info, created)."""
        content_hash = trie.meta["content_hash"]
        counter, hash_key = self._key(name, "counter"), self._key(name, "hash", content_hash)
        with self.r.pipeline() as p:
            while True:
                try:
                    p.watch(counter, hash_key, self._key(name, "latest"))
                    existing = p.get(hash_key)
                    if existing is not None and p.exists(self._key(name, "blob", int(existing))):
                        p.unwatch()
                        return self.set_latest(name, int(existing)), False
                    version = int(p.get(counter) or 0) + 1
                    trie.meta.update(name=name, version=version, created_unix=time.time())
                    info = self._info_from_trie(trie)
                    p.multi()
                    p.set(counter, version)
                    p.set(self._key(name, "blob", version), trie.to_blob())
                    p.set(self._key(name, "info", version), json.dumps(info.__dict__))
                    p.set(hash_key, version)
                    p.zadd(self._key(name, "versions"), {str(version): version})
                    p.sadd(f"{self.ns}:catalogs", name)
                    p.set(self._key(name, "latest"), version)
                    p.publish(self.channel, json.dumps({"name": name, "version": version, "event": "publish"}))
                    p.execute()
                    break
                except redis.WatchError:
                    continue
        self._trim(name)
        return VersionInfo(**{**info.__dict__, "latest": True}), True

    def set_latest(self, name: str, version: int) -> VersionInfo:
        """Point latest at a stored version (a rollback) and announce it; a no-op if it already is."""
        latest_key, blob_key = self._key(name, "latest"), self._key(name, "blob", version)
        with self.r.pipeline() as p:
            while True:
                try:
                    p.watch(latest_key, blob_key)
                    if not p.exists(blob_key):
                        p.unwatch()
                        raise NotFound(f"catalog {name!r} has no version {version}")
                    if int(p.get(latest_key) or 0) == version:
                        p.unwatch()
                        break
                    p.multi()
                    p.set(latest_key, version)
                    p.publish(self.channel, json.dumps({"name": name, "version": version, "event": "rollback"}))
                    p.execute()
                    break
                except redis.WatchError:
                    continue
        return self.info(name, version)

    def _trim(self, name: str) -> None:
        """Drop all but the newest keep_versions versions, never the one latest names."""
        versions = [int(v) for v in self.r.zrange(self._key(name, "versions"), 0, -1)]
        old = versions[:-self.keep_versions]
        if not old:
            return
        latest_key = self._key(name, "latest")
        with self.r.pipeline() as p:
            while True:
                try:
                    p.watch(latest_key)
                    latest = int(p.get(latest_key) or 0)
                    drop = [v for v in old if v != latest]
                    p.multi()
                    for v in drop:
                        vectors = list(self.r.scan_iter(match=self._key(name, "vectors", v, "*")))
                        p.delete(self._key(name, "blob", v), self._key(name, "info", v), *vectors)
                        p.zrem(self._key(name, "versions"), str(v))
                    p.execute()
                    return
                except redis.WatchError:
                    continue

    # --- reads -----------------------------------------------------------------------------
    def latest_version(self, name: str) -> int:
        v = self.r.get(self._key(name, "latest"))
        if v is None:
            raise NotFound(f"no catalog named {name!r}")
        return int(v)

    def resolve(self, name: str, version: int = 0) -> int:
        """The version a request pins: the given one, or latest when version is 0."""
        return version if version else self.latest_version(name)

    def blob(self, name: str, version: int = 0) -> bytes:
        version = self.resolve(name, version)
        data = self.r.get(self._key(name, "blob", version))
        if data is None:
            raise NotFound(f"catalog {name!r} has no version {version}")
        return data

    def vectors(self, name: str, version: int, encoder_digest: str) -> bytes | None:
        """A version's stored tool vectors for this encoder (decoder_service.retrieval's blob), or None."""
        return self.r.get(self._key(name, "vectors", version, encoder_digest))

    def put_vectors(self, name: str, version: int, encoder_digest: str, blob: bytes) -> None:
        """Keep a version's tool vectors so that a restart or another replica does not compute them again."""
        self.r.set(self._key(name, "vectors", version, encoder_digest), blob)

    def info(self, name: str, version: int = 0) -> VersionInfo:
        version = self.resolve(name, version)
        raw, latest = self.r.mget(self._key(name, "info", version), self._key(name, "latest"))
        if raw is None:
            raise NotFound(f"catalog {name!r} has no version {version}")
        return VersionInfo(**{**json.loads(raw), "latest": latest is not None and int(latest) == version})

    def list_versions(self, name: str) -> list[VersionInfo]:
        versions = [int(v) for v in self.r.zrange(self._key(name, "versions"), 0, -1)]
        if not versions:
            raise NotFound(f"no catalog named {name!r}")
        return [self.info(name, v) for v in versions]

    def list_catalogs(self) -> list[VersionInfo]:
        names = sorted(n.decode() for n in self.r.smembers(f"{self.ns}:catalogs"))
        return [self.info(n) for n in names]

    @staticmethod
    def _info_from_trie(trie: Trie) -> VersionInfo:
        m = trie.meta
        return VersionInfo(name=m["name"], version=m["version"], content_hash=m["content_hash"],
                           tokenizer_hash=m["tokenizer_hash"], created_unix=m["created_unix"],
                           stats={**trie.stats(), "compile_ms": m.get("compile_ms", 0.0)})

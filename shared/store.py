"""The versioned catalog store in Redis.

Per catalog name, versions 1, 2, 3, ... Publishing writes the blob, its info, the content-hash index
and the `latest` pointer and announces `{name, version}` on the event channel in one MULTI/EXEC (deleting
removes them all and announces `{name, "event": "delete"}` the same way),
guarded by WATCH on the version counter: no reader sees `latest` name a missing blob, and two
concurrent publishers never get the same version. All keys live under the namespace.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import time
from dataclasses import dataclass

import redis

from shared.trie import Trie


class NotFound(KeyError):
    """No such catalog, or no such version of it."""

    def __str__(self) -> str:
        return self.args[0]


class LatestMoved(Exception):
    """A write made on top of one version found another latest: a writer published or rolled back meanwhile
    (ABORTED: read the latest again and redo)."""


class BlobRejected(ValueError):
    """A stored blob that does not match what the compiler recorded for it (its digest, its signature,
    its key): never served. reason names the check that failed (a metric label: signature, digest, key,
    unreadable, arrays)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def blob_digest(blob: bytes) -> str:
    """sha256 of a version's blob exactly as stored (arrays and metadata), recorded in its info."""
    return hashlib.sha256(blob).hexdigest()


def blob_signature(key: bytes, name: str, version: int, blob: bytes) -> str:
    """HMAC-SHA256 binding a blob to its catalog name and version (a blob moved under another key, or
    changed, no longer matches)."""
    mac = hmac.new(key, f"tooltrie-blob-1\0{name}\0{version}\0".encode(), hashlib.sha256)
    mac.update(blob)
    return mac.hexdigest()


SIGNED = b"tooltrie-signed-1\0"   # what starts a stored artifact signed with the key: then its HMAC (64 hex digits)


def artifact_signature(key: bytes, kind: str, name: str, version: int, part: str, data: bytes) -> str:
    """HMAC-SHA256 binding an artifact a decoder stores beside a version (its tool vectors: kind "vectors", part
    the encoder's digest) to that version: moved under another key, or changed, it no longer matches."""
    mac = hmac.new(key, f"tooltrie-{kind}-1\0{name}\0{version}\0{part}\0".encode(), hashlib.sha256)
    mac.update(data)
    return mac.hexdigest()


@dataclass(frozen=True)
class VersionInfo:
    name: str
    version: int
    content_hash: str
    tokenizer_hash: str
    created_unix: float
    stats: dict
    latest: bool = False
    blob_sha256: str = ""   # digest of the blob as stored (empty: stored before digests were recorded)
    signature: str = ""     # HMAC of the blob with the signing key (empty: published without one)


def redis_client(url: str, ca_file: str = "", cert_file: str = "", key_file: str = "", **kw) -> redis.Redis:
    """A Redis client for url: redis:// or rediss:// (TLS; the server is verified against ca_file, or the
    system's CAs; cert_file and key_file for a server that requires client certificates); an ACL user and
    password go in the URL (rediss://user:password@host:port/0)."""
    options = dict(socket_timeout=5, socket_connect_timeout=2, health_check_interval=10, **kw)
    if url.startswith("rediss://"):
        options.update(ssl_cert_reqs="required")
        if ca_file:
            options["ssl_ca_certs"] = ca_file
        if cert_file:
            options.update(ssl_certfile=cert_file, ssl_keyfile=key_file or None)
    return redis.Redis.from_url(url, **options)


class CatalogStore:
    def __init__(self, client: redis.Redis, namespace: str = "tooltrie", keep_versions: int = 10,
                 signing_key: bytes | str = b""):
        self.r = client
        self.ns = namespace
        self.keep_versions = max(1, keep_versions)
        self.signing_key = signing_key.encode() if isinstance(signing_key, str) else signing_key

    @classmethod
    def from_url(cls, url: str, namespace: str = "tooltrie", keep_versions: int = 10, signing_key: bytes | str = b"",
                 ca_file: str = "", cert_file: str = "", key_file: str = "") -> "CatalogStore":
        return cls(redis_client(url, ca_file, cert_file, key_file), namespace, keep_versions, signing_key)

    @classmethod
    def from_settings(cls, settings, keep_versions: int | None = None) -> "CatalogStore":
        return cls.from_url(settings.redis_url, settings.namespace,
                            settings.keep_versions if keep_versions is None else keep_versions,
                            settings.signing_key, settings.redis_ca, settings.redis_cert, settings.redis_key)

    # --- keys ------------------------------------------------------------------------------
    @property
    def channel(self) -> str:
        return f"{self.ns}:events"

    def _key(self, name: str, *parts) -> str:
        return ":".join([self.ns, "cat", name, *map(str, parts)])

    # --- writes ----------------------------------------------------------------------------
    def publish(self, name: str, trie: Trie, on_latest: int | None = None) -> tuple[VersionInfo, bool]:
        """Store trie as the next version of name and make it latest; identical content returns
        (and makes latest again, announced as a rollback) the version that already holds it.
        Returns (info, created). The info records the blob's digest, and its HMAC when the store has a
        signing key, so that a decoder can refuse a blob changed after it was published. With on_latest (a
        version the trie was built from), the publish is a compare-and-set: LatestMoved, and nothing written,
        unless that version is still the latest when it is written."""
        content_hash = trie.meta["content_hash"]
        counter, hash_key = self._key(name, "counter"), self._key(name, "hash", content_hash)
        latest_key = self._key(name, "latest")
        with self.r.pipeline() as p:
            while True:
                try:
                    p.watch(counter, hash_key, latest_key)
                    if on_latest is not None and int(p.get(latest_key) or 0) != on_latest:
                        p.unwatch()
                        raise LatestMoved(f"catalog {name!r}: v{on_latest} is no longer the latest")
                    existing = p.get(hash_key)
                    if existing is not None and p.exists(self._key(name, "blob", int(existing))):
                        p.unwatch()
                        return self.set_latest(name, int(existing), on_latest), False
                    version = int(p.get(counter) or 0) + 1
                    trie.meta.update(name=name, version=version, created_unix=time.time())
                    blob = trie.to_blob()
                    info = self._info_from_trie(trie, blob_sha256=blob_digest(blob), signature=(
                        blob_signature(self.signing_key, name, version, blob) if self.signing_key else ""))
                    p.multi()
                    p.set(counter, version)
                    p.set(self._key(name, "blob", version), blob)
                    p.set(self._key(name, "info", version), json.dumps(info.__dict__))
                    p.set(hash_key, version)
                    p.zadd(self._key(name, "versions"), {str(version): version})
                    p.sadd(f"{self.ns}:catalogs", name)
                    p.set(latest_key, version)
                    p.publish(self.channel, json.dumps({"name": name, "version": version, "event": "publish"}))
                    p.execute()
                    break
                except redis.WatchError:
                    continue
        self._trim(name)
        return VersionInfo(**{**info.__dict__, "latest": True}), True

    def set_latest(self, name: str, version: int, on_latest: int | None = None) -> VersionInfo:
        """Point latest at a stored version (a rollback) and announce it; a no-op if it already is. With
        on_latest, only while that version is the latest (else LatestMoved), as publish."""
        latest_key, blob_key = self._key(name, "latest"), self._key(name, "blob", version)
        with self.r.pipeline() as p:
            while True:
                try:
                    p.watch(latest_key, blob_key)
                    if not p.exists(blob_key):
                        p.unwatch()
                        raise NotFound(f"catalog {name!r} has no version {version}")
                    if on_latest is not None and int(p.get(latest_key) or 0) != on_latest:
                        p.unwatch()
                        raise LatestMoved(f"catalog {name!r}: v{on_latest} is no longer the latest")
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

    def delete(self, name: str) -> int:
        """Remove the catalog: its versions (blobs, infos, content-hash index, stored vectors), its latest
        pointer and leases, and its place in the catalog list, and announce `{name, "event": "delete"}`, in one
        transaction (a publish racing it retries). Its version counter stays: a later publish of the name starts
        a fresh catalog whose versions number on, so a decoder, a lease or a vectors key never takes one number
        for two contents. Returns how many versions were removed."""
        counter, latest_key = self._key(name, "counter"), self._key(name, "latest")
        with self.r.pipeline() as p:
            while True:
                try:
                    p.watch(counter, latest_key, self._key(name, "versions"))
                    versions = p.zcard(self._key(name, "versions"))
                    if not p.exists(latest_key):
                        p.unwatch()
                        raise NotFound(f"no catalog named {name!r}")
                    keys = [k for k in self.r.scan_iter(match=self._key(name, "*"), count=1000)
                            if k.decode() != counter]
                    p.multi()
                    p.delete(*keys)
                    p.srem(f"{self.ns}:catalogs", name)
                    p.publish(self.channel, json.dumps({"name": name, "event": "delete"}))
                    p.execute()
                    return versions
                except redis.WatchError:
                    continue

    # --- leases: versions a decoder has loaded or a request pins are never trimmed ----------------
    def lease(self, name: str, versions, holder: str, ttl: float) -> None:
        """Hold versions of name for holder for ttl seconds (refreshed by the holder while it uses them)."""
        now = self._now()
        with self.r.pipeline(transaction=False) as p:
            key = self._key(name, "leases")
            p.zadd(key, {f"{v}:{holder}": now + ttl for v in versions})
            p.zremrangebyscore(key, "-inf", now)
            p.execute()

    def unlease(self, name: str, version: int, holder: str) -> None:
        self.r.zrem(self._key(name, "leases"), f"{version}:{holder}")

    def leased(self, name: str, client=None) -> set[int]:
        """Versions of name some holder's unexpired lease names (read through client when given: _trim's
        watching pipeline)."""
        members = (client or self.r).zrangebyscore(self._key(name, "leases"), self._now(), "+inf")
        return {int(m.split(b":", 1)[0]) for m in members}

    def _now(self) -> float:
        seconds, micros = self.r.time()   # the server's clock: holders' clocks may disagree
        return seconds + micros / 1e6

    def _trim(self, name: str) -> None:
        """Drop all but the newest keep_versions versions, never the one latest names nor one a holder
        leases (a decoder has it loaded, or a request pins it)."""
        versions = [int(v) for v in self.r.zrange(self._key(name, "versions"), 0, -1)]
        old = versions[:-self.keep_versions]
        if not old:
            return
        latest_key, lease_key = self._key(name, "latest"), self._key(name, "leases")
        with self.r.pipeline() as p:
            while True:
                try:
                    p.watch(latest_key, lease_key)
                    latest = int(p.get(latest_key) or 0)
                    leased = self.leased(name, p)
                    drop = [v for v in old if v != latest and v not in leased]
                    if not drop:
                        p.unwatch()
                        return
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

    def verified_blob(self, name: str, version: int) -> bytes:
        """The blob of one version, checked against its info: the digest the compiler recorded and, when
        this store has a signing key, its HMAC over the name, the version and the blob. Raises
        BlobRejected (or NotFound)."""
        blob = self.blob(name, version)
        info = self.info(name, version)
        if info.name != name or info.version != version:
            raise BlobRejected(f"catalog {name!r} v{version}: its info names {info.name!r} v{info.version}", "key")
        if self.signing_key:
            if not info.signature:
                raise BlobRejected(f"catalog {name!r} v{version} is not signed, and a signing key is set", "signature")
            expected = blob_signature(self.signing_key, name, version, blob)
            if not hmac.compare_digest(expected, info.signature):
                raise BlobRejected(f"catalog {name!r} v{version}: the blob's signature does not match "
                                   "(changed after publishing, stored under another key, or another signing key)",
                                   "signature")
        if info.blob_sha256 and not hmac.compare_digest(blob_digest(blob), info.blob_sha256):
            raise BlobRejected(f"catalog {name!r} v{version}: the blob's sha256 is not the one recorded at "
                               "publishing (changed or truncated in Redis)", "digest")
        return blob

    def vectors(self, name: str, version: int, encoder_digest: str) -> bytes | None:
        """A version's stored tool vectors for this encoder (decoder_service.retrieval.vectors' blob), or None; with a
        signing key, only vectors signed with it for this version and encoder (else BlobRejected: a Redis
        writer must not choose what ranks first)."""
        stored = self.r.get(self._key(name, "vectors", version, encoder_digest))
        if stored is None:
            return None
        signed = stored.startswith(SIGNED)
        data = stored[len(SIGNED) + 64:] if signed else stored
        if self.signing_key:
            expected = artifact_signature(self.signing_key, "vectors", name, version, encoder_digest, data)
            if not signed or not hmac.compare_digest(stored[len(SIGNED):len(SIGNED) + 64], expected.encode()):
                raise BlobRejected(f"catalog {name!r} v{version}: its stored tool vectors are "
                                   f"{'not signed with this key' if signed else 'not signed'}, and a signing key "
                                   "is set", "signature")
        return data

    def put_vectors(self, name: str, version: int, encoder_digest: str, blob: bytes) -> None:
        """Keep a version's tool vectors so that a restart or another replica does not compute them again
        (signed when the store has a signing key)."""
        if self.signing_key:
            blob = SIGNED + artifact_signature(self.signing_key, "vectors", name, version, encoder_digest,
                                               blob).encode() + blob
        self.r.set(self._key(name, "vectors", version, encoder_digest), blob)

    def has_version(self, name: str, version: int) -> bool:
        return bool(self.r.exists(self._key(name, "blob", version)))

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

    def catalog_names(self) -> list[str]:
        return sorted(n.decode("utf-8", "replace") for n in self.r.smembers(f"{self.ns}:catalogs"))

    def list_catalogs(self) -> list[VersionInfo]:
        return [self.info(n) for n in self.catalog_names()]

    @staticmethod
    def _info_from_trie(trie: Trie, **extra) -> VersionInfo:
        m = trie.meta
        return VersionInfo(name=m["name"], version=m["version"], content_hash=m["content_hash"],
                           tokenizer_hash=m["tokenizer_hash"], created_unix=m["created_unix"],
                           stats={**trie.stats(), "compile_ms": m.get("compile_ms", 0.0)}, **extra)

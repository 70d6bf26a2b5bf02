"""A small Python client for orchestrators: Discover as an iterator (sync) or async iterator (asyncio).

    with DecoderClient() as client:          # TOOLTRIE_DECODER_ADDR, TLS and token from the settings
        for tool in client.discover("metatool", "what's the weather in Paris?", k=2):
            print(tool.name, tool.logprob)

Several replicas (a `dns:///` target, round-robin), TLS and the bearer token: docs/deploy.md.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import grpc

from shared.config import Settings
from shared.rpc import decoder_pb2 as pb, decoder_pb2_grpc as pb_grpc

ROUND_ROBIN = [("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}]}))]


@dataclass(frozen=True)
class Tool:
    """One tool of an answer: a streamed Pointer event with the catalog version that answered."""
    index: int             # its place in the answer: a ranking, best first
    name: str
    logprob: float         # the generator's constrained log-probability (0 in retrieval-only mode)
    catalog: str
    version: int
    retrieval_score: float  # the first stage's fused score
    retrieval_rank: int     # its rank in the shortlist the prompt listed
    description: str = ""   # with include_definitions: the tool's description
    input_schema: dict | None = None  # with include_definitions: its input schema (None when it has none)
    confidence: float = 0.0  # calibrated chance, in [0, 1], that it is a tool the caller wanted (never above the
                             # previous tool's)


class _Answer:
    """Reads one Discover stream: remembers the Accepted version and the Done timings, turns each
    Pointer into a Tool (the same for the sync and the asyncio client)."""

    def __init__(self):
        self.accepted = self.done = None

    def read(self, event) -> Tool | None:
        kind = event.WhichOneof("event")
        if kind == "accepted":
            self.accepted = event.accepted
        elif kind == "done":
            self.done = event.done
        else:
            p = event.pointer
            return Tool(p.index, p.name, p.logprob, self.accepted.catalog, self.accepted.version, p.retrieval_score,
                        p.retrieval_rank, p.description, json.loads(p.input_schema) if p.input_schema else None,
                        p.confidence)
        return None


def channel_credentials(settings: Settings) -> grpc.ChannelCredentials | None:
    """TLS credentials for a client from the settings, or None (plaintext)."""
    if not settings.tls:
        return None

    def read(path):
        return Path(path).read_bytes() if path else None

    return grpc.ssl_channel_credentials(read(settings.tls_ca), read(settings.tls_client_key),
                                        read(settings.tls_client_cert))


def open_channel(target: str, settings: Settings | None = None, aio: bool = False, options=()):
    """A channel to target, with TLS when the settings ask for it (and the server name to verify)."""
    settings = settings or Settings()
    options = [*options]
    if settings.tls_server_name:
        options.append(("grpc.ssl_target_name_override", settings.tls_server_name))
    creds = channel_credentials(settings)
    mod = grpc.aio if aio else grpc
    if creds is None:
        return mod.insecure_channel(target, options=options)
    return mod.secure_channel(target, creds, options=options)


def bearer(token: str | None) -> list[tuple[str, str]]:
    """Call metadata carrying a bearer token (none without one)."""
    return [("authorization", f"Bearer {token}")] if token else []


def _request(catalog, intent, k, version, allow, request_id, shortlist=0, retrieve_only=False,
             include_definitions=False, decode=False, min_confidence=0.0) -> pb.DiscoverRequest:
    mode = pb.MODE_RETRIEVE if retrieve_only else pb.MODE_DECODE if decode else pb.MODE_AUTO
    return pb.DiscoverRequest(catalog=catalog, intent=intent, k=k, version=version, allow=allow or [],
                              request_id=request_id or "", shortlist=shortlist, mode=mode,
                              include_definitions=include_definitions, min_confidence=min_confidence)


class _Client:
    """target defaults to TOOLTRIE_DECODER_ADDR, token to TOOLTRIE_DISCOVER_TOKEN, TLS to the settings."""
    aio = False

    def __init__(self, target: str | None = None, timeout: float = 60.0, token: str | None = None,
                 settings: Settings | None = None):
        settings = settings or Settings()
        self.channel = open_channel(target or settings.decoder_addr, settings, aio=self.aio, options=ROUND_ROBIN)
        self.stub = pb_grpc.DecoderServiceStub(self.channel)
        self.timeout = timeout
        self.metadata = bearer(settings.discover_token if token is None else token)
        self.accepted = self.done = None   # the last answer's Accepted (its version) and Done, once it has ended


class DecoderClient(_Client):
    """The blocking client (use it in `with`, or close())."""

    def discover(self, catalog: str, intent: str, k: int, version: int = 0, allow: list[str] | None = None,
                 request_id: str | None = None, shortlist: int = 0, retrieve_only: bool = False,
                 include_definitions: bool = False, decode: bool = False, min_confidence: float = 0.0):
        """Yield each Tool as soon as the decoder completes it, best first; afterwards .done holds the timings
        and which stage chose the answer. shortlist: tools retrieved into the prompt (0: the server's default);
        retrieve_only: the shortlist's first k, no generator; decode: the generator even where it cannot change
        the answer (by default it runs only where it can); include_definitions: each Tool also carries its
        description and input schema, so that it can be called without a copy of the registry; min_confidence:
        only the tools whose confidence reaches it (the answer's head, maybe none; .done.cut says how many of the k
        were cut), where 0 answers exactly k."""
        answer = _Answer()
        request = _request(catalog, intent, k, version, allow, request_id, shortlist, retrieve_only,
                           include_definitions, decode, min_confidence)
        for event in self.stub.Discover(request, timeout=self.timeout, metadata=self.metadata):
            tool = answer.read(event)
            if tool:
                yield tool
        self.accepted, self.done = answer.accepted, answer.done

    def info(self) -> pb.GetInfoResponse:
        return self.stub.GetInfo(pb.GetInfoRequest(), timeout=self.timeout, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncDecoderClient(_Client):
    """The asyncio client (use it in `async with`, or await close()); the same defaults as DecoderClient."""
    aio = True

    async def discover(self, catalog: str, intent: str, k: int, version: int = 0, allow: list[str] | None = None,
                       request_id: str | None = None, shortlist: int = 0, retrieve_only: bool = False,
                       include_definitions: bool = False, decode: bool = False, min_confidence: float = 0.0):
        """DecoderClient.discover for asyncio."""
        answer = _Answer()
        request = _request(catalog, intent, k, version, allow, request_id, shortlist, retrieve_only,
                           include_definitions, decode, min_confidence)
        async for event in self.stub.Discover(request, timeout=self.timeout, metadata=self.metadata):
            tool = answer.read(event)
            if tool:
                yield tool
        self.accepted, self.done = answer.accepted, answer.done

    async def info(self) -> pb.GetInfoResponse:
        return await self.stub.GetInfo(pb.GetInfoRequest(), timeout=self.timeout, metadata=self.metadata)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

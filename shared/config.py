"""Settings both services read, from environment variables with documented defaults.

One place names every variable, so the README, the Kubernetes ConfigMaps and the code agree.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BASE_MODEL_DIR = REPO_ROOT / "models" / "SmolLM2-135M-Instruct"            # converted from its PyPI wheel
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "SmolLM2-135M-Instruct-tuned"    # the base + tune/adapters (make model)
DEFAULT_ENCODER_DIR = REPO_ROOT / "models" / "all-MiniLM-L6-v2"
DEFAULT_READER_DIR = REPO_ROOT / "models" / "SmolLM2-135M-Instruct-writer"   # the base + tune/writer_adapters

# Environment variable -> (default, meaning). Read by Settings and listed by `tooltrie env`.
ENV_VARS: dict[str, tuple[str, str]] = {
    "REDIS_URL": ("", "Redis to use; empty means the project starts its own redis-server under var/"),
    "TOOLTRIE_NAMESPACE": ("tooltrie", "prefix of every Redis key and of the event channel"),
    "TOOLTRIE_MODEL_DIR": (str(DEFAULT_MODEL_DIR), "Hugging Face-layout model directory"),
    "TOOLTRIE_ENCODER_DIR": (str(DEFAULT_ENCODER_DIR), "the dense retriever's sentence encoder (BERT family, "
                             "Hugging Face layout); empty: BM25 alone"),
    "TOOLTRIE_READER_DIR": (str(DEFAULT_READER_DIR), "decoder: the reader, a model that reranks the shortlist of a "
                            "catalog the selector was not tuned on by how likely each tool makes the request "
                            "(docs/quality.md); empty: such a catalog is answered in retrieval's order"),
    "TOOLTRIE_SHORTLIST": ("12", "decoder: tools retrieved into a request's prompt (a request may ask for another)"),
    "TOOLTRIE_FUSION_WEIGHT": ("1", "decoder: logits one retrieval rank is worth in the answer's order "
                               "(0: the generator alone; large: retrieval's order; docs/quality.md)"),
    "TOOLTRIE_FUSION_WEIGHT_UNSEEN": ("1000", "decoder: the same for a catalog the model was not tuned on (under "
                                      "half its tools in the model's tuned_tools.json)"),
    "TOOLTRIE_LINE_KV": ("0", "decoder: 1 computes each tool line's K/V once and copies it into the requests that "
                         "list it (a line attends to the prefix and itself only): for a selector trained so"),
    "TOOLTRIE_COMPILER_ADDR": ("127.0.0.1:50051", "host:port the compiler service listens on"),
    "TOOLTRIE_DECODER_ADDR": ("127.0.0.1:50052", "host:port the decoder service listens on"),
    "TOOLTRIE_METRICS_PORT": ("9464", "HTTP port for Prometheus metrics (0 disables)"),
    "TOOLTRIE_MAX_TOOLS": ("100000", "most tools one catalog may hold"),
    "TOOLTRIE_MAX_NAME_CHARS": ("256", "longest tool name, in characters"),
    "TOOLTRIE_MAX_DESCRIPTION_CHARS": ("10000", "longest tool description (or example), in characters"),
    "TOOLTRIE_MAX_SCHEMA_CHARS": ("20000", "longest tool input schema (MCP inputSchema, OpenAI parameters), in "
                                  "characters of its JSON"),
    "TOOLTRIE_MAX_EXAMPLES": ("100000", "most examples one catalog's tools may carry in all (the decoder encodes "
                              "each once per version)"),
    "TOOLTRIE_KEEP_VERSIONS": ("10", "versions kept per catalog (the latest is never dropped)"),
    "TOOLTRIE_BACKEND": ("auto", "decoder backend: auto, cuda or cpu"),
    "TOOLTRIE_DRAIN_SECONDS": ("30", "grace period for in-flight requests after SIGTERM"),
    "TOOLTRIE_CATALOGS": ("", "comma-separated catalogs the decoder serves; empty means every published one"),
    "TOOLTRIE_KV_TOKENS": ("65536", "decoder KV pool size in token positions"),
    "TOOLTRIE_MAX_SEQS": ("0", "decoder: sequences decoded at once; 0: the backend's measured default (64 on a "
                          "GPU, 2 on the CPU: docs/performance.md, A1)"),
    "TOOLTRIE_MAX_WAITING": ("256", "decoder: bounded request queue; past it RESOURCE_EXHAUSTED"),
    # --- security and reliability (docs/deploy.md, "Security") ---
    "TOOLTRIE_METRICS_HOST": ("127.0.0.1", "address the Prometheus metrics listen on (0.0.0.0: every interface)"),
    "TOOLTRIE_REFLECTION": ("0", "1: enable gRPC server reflection (grpcurl list) on both services"),
    "TOOLTRIE_TLS_CERT": ("", "PEM certificate (chain) a server presents; with TOOLTRIE_TLS_KEY, the servers "
                          "listen with TLS only"),
    "TOOLTRIE_TLS_KEY": ("", "PEM private key of TOOLTRIE_TLS_CERT"),
    "TOOLTRIE_TLS_CLIENT_CA": ("", "server: PEM CA bundle; when set, clients must present a certificate it "
                               "signed (mutual TLS)"),
    "TOOLTRIE_TLS_CA": ("", "client: PEM CA bundle to verify the servers with; set (or TOOLTRIE_TLS=1) to "
                        "connect with TLS"),
    "TOOLTRIE_TLS": ("0", "client: 1 connects with TLS, verifying servers against the system's CAs unless "
                     "TOOLTRIE_TLS_CA is set"),
    "TOOLTRIE_TLS_CLIENT_CERT": ("", "client: PEM certificate to present for mutual TLS"),
    "TOOLTRIE_TLS_CLIENT_KEY": ("", "client: PEM private key of TOOLTRIE_TLS_CLIENT_CERT"),
    "TOOLTRIE_TLS_SERVER_NAME": ("", "client: the name to verify in the server's certificate, when it is not "
                                 "the host of the address"),
    "TOOLTRIE_PUBLISH_TOKEN": ("", "bearer token that Publish, SetLatest, Delete and blob reads require (the CLI "
                               "sends it); empty: no token (then only TOOLTRIE_PUBLISH_IDENTITIES, or nothing, "
                               "guards them)"),
    "TOOLTRIE_PUBLISH_IDENTITIES": ("", "comma-separated client certificate names (CN or SAN, mutual TLS) "
                                    "allowed to publish, roll back, delete and read blobs"),
    "TOOLTRIE_DISCOVER_TOKEN": ("", "bearer token Discover and GetInfo require (clients send it); empty: "
                                "open"),
    "TOOLTRIE_SIGNING_KEY": ("", "HMAC key: the compiler signs each version's blob with it and the decoder "
                             "refuses blobs whose signature does not match (same value on both)"),
    "TOOLTRIE_REDIS_CA": ("", "PEM CA bundle to verify a rediss:// (TLS) Redis with"),
    "TOOLTRIE_REDIS_CERT": ("", "PEM client certificate for a Redis that requires one"),
    "TOOLTRIE_REDIS_KEY": ("", "PEM private key of TOOLTRIE_REDIS_CERT"),
    "TOOLTRIE_MAX_CONNECTION_AGE_S": ("300", "decoder: connections are asked to reconnect after this many "
                                      "seconds (streams in flight are never cut); 0 disables"),
    "TOOLTRIE_LEASE_SECONDS": ("60", "decoder: lifetime of its leases on the versions it holds (refreshed "
                               "every third of it); the store never trims a leased version"),
}


def _env(name: str) -> str:
    return os.environ.get(name, ENV_VARS[name][0])


@dataclass(frozen=True)
class Settings:
    redis_url: str = field(default_factory=lambda: _env("REDIS_URL"))
    namespace: str = field(default_factory=lambda: _env("TOOLTRIE_NAMESPACE"))
    model_dir: Path = field(default_factory=lambda: Path(_env("TOOLTRIE_MODEL_DIR")))
    encoder_dir: str = field(default_factory=lambda: _env("TOOLTRIE_ENCODER_DIR"))
    reader_dir: str = field(default_factory=lambda: _env("TOOLTRIE_READER_DIR"))
    shortlist: int = field(default_factory=lambda: int(_env("TOOLTRIE_SHORTLIST")))
    fusion_weight: float = field(default_factory=lambda: float(_env("TOOLTRIE_FUSION_WEIGHT")))
    fusion_weight_unseen: float = field(default_factory=lambda: float(_env("TOOLTRIE_FUSION_WEIGHT_UNSEEN")))
    line_kv: bool = field(default_factory=lambda: _env("TOOLTRIE_LINE_KV") == "1")
    compiler_addr: str = field(default_factory=lambda: _env("TOOLTRIE_COMPILER_ADDR"))
    decoder_addr: str = field(default_factory=lambda: _env("TOOLTRIE_DECODER_ADDR"))
    metrics_port: int = field(default_factory=lambda: int(_env("TOOLTRIE_METRICS_PORT")))
    max_tools: int = field(default_factory=lambda: int(_env("TOOLTRIE_MAX_TOOLS")))
    max_name_chars: int = field(default_factory=lambda: int(_env("TOOLTRIE_MAX_NAME_CHARS")))
    max_description_chars: int = field(
        default_factory=lambda: int(_env("TOOLTRIE_MAX_DESCRIPTION_CHARS")))
    max_schema_chars: int = field(default_factory=lambda: int(_env("TOOLTRIE_MAX_SCHEMA_CHARS")))
    max_examples: int = field(default_factory=lambda: int(_env("TOOLTRIE_MAX_EXAMPLES")))
    keep_versions: int = field(default_factory=lambda: int(_env("TOOLTRIE_KEEP_VERSIONS")))
    backend: str = field(default_factory=lambda: _env("TOOLTRIE_BACKEND"))
    drain_seconds: float = field(default_factory=lambda: float(_env("TOOLTRIE_DRAIN_SECONDS")))
    catalogs: list[str] = field(default_factory=lambda: [c for c in _env("TOOLTRIE_CATALOGS").split(",") if c])
    kv_tokens: int = field(default_factory=lambda: int(_env("TOOLTRIE_KV_TOKENS")))
    max_seqs: int = field(default_factory=lambda: int(_env("TOOLTRIE_MAX_SEQS")))
    max_waiting: int = field(default_factory=lambda: int(_env("TOOLTRIE_MAX_WAITING")))
    metrics_host: str = field(default_factory=lambda: _env("TOOLTRIE_METRICS_HOST"))
    reflection: bool = field(default_factory=lambda: _env("TOOLTRIE_REFLECTION") == "1")
    tls_cert: str = field(default_factory=lambda: _env("TOOLTRIE_TLS_CERT"))
    tls_key: str = field(default_factory=lambda: _env("TOOLTRIE_TLS_KEY"))
    tls_client_ca: str = field(default_factory=lambda: _env("TOOLTRIE_TLS_CLIENT_CA"))
    tls_ca: str = field(default_factory=lambda: _env("TOOLTRIE_TLS_CA"))
    tls: bool = field(default_factory=lambda: _env("TOOLTRIE_TLS") == "1" or bool(_env("TOOLTRIE_TLS_CA")))
    tls_client_cert: str = field(default_factory=lambda: _env("TOOLTRIE_TLS_CLIENT_CERT"))
    tls_client_key: str = field(default_factory=lambda: _env("TOOLTRIE_TLS_CLIENT_KEY"))
    tls_server_name: str = field(default_factory=lambda: _env("TOOLTRIE_TLS_SERVER_NAME"))
    publish_token: str = field(default_factory=lambda: _env("TOOLTRIE_PUBLISH_TOKEN"))
    publish_identities: list[str] = field(
        default_factory=lambda: [c.strip() for c in _env("TOOLTRIE_PUBLISH_IDENTITIES").split(",") if c.strip()])
    discover_token: str = field(default_factory=lambda: _env("TOOLTRIE_DISCOVER_TOKEN"))
    signing_key: str = field(default_factory=lambda: _env("TOOLTRIE_SIGNING_KEY"))
    redis_ca: str = field(default_factory=lambda: _env("TOOLTRIE_REDIS_CA"))
    redis_cert: str = field(default_factory=lambda: _env("TOOLTRIE_REDIS_CERT"))
    redis_key: str = field(default_factory=lambda: _env("TOOLTRIE_REDIS_KEY"))
    max_connection_age_s: float = field(default_factory=lambda: float(_env("TOOLTRIE_MAX_CONNECTION_AGE_S")))
    lease_seconds: float = field(default_factory=lambda: float(_env("TOOLTRIE_LEASE_SECONDS")))

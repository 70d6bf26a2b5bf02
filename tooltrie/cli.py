"""The `tooltrie` command: compile a registry, publish and manage catalog versions, discover tools.

Exit codes: 0 done, 2 bad input (the registry, a name, an argument), 1 anything else (service
unreachable, not found, internal error). Errors are one line on stderr.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import grpc

from shared.config import Settings

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1


def _fail(message: str, code: int) -> int:
    print(f"tooltrie: {message}", file=sys.stderr)
    return code


class InputError(Exception):
    """A command-line input that cannot be used (an unreadable file)."""


def _read(path: str) -> str:
    try:
        return sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read {path}: {e}") from None


def cmd_compile(args) -> int:
    from compiler_service.compiler import compile_catalog
    from shared.catalog import CatalogError, parse_registry
    from shared.tokenizer import ModelTokenizer, TokenizerError
    try:
        trie = compile_catalog(parse_registry(_read(args.file)), ModelTokenizer(args.model))
    except (CatalogError, TokenizerError) as e:
        return _fail(str(e), EXIT_BAD_INPUT)
    stats = {**trie.stats(), "compile_ms": trie.meta["compile_ms"], "tokenizer_hash": trie.meta["tokenizer_hash"],
             "content_hash": trie.meta["content_hash"]}
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        print(" ".join(f"{k}={v}" for k, v in stats.items()))
    if args.out:
        Path(args.out).write_bytes(trie.to_blob())
    return 0


class _Authorized:
    """A compiler stub whose calls carry the publish token (TOOLTRIE_PUBLISH_TOKEN or --token)."""

    def __init__(self, stub, metadata):
        self._stub, self._metadata = stub, metadata

    def __getattr__(self, method):
        call = getattr(self._stub, method)
        return lambda request, **kw: call(request, metadata=self._metadata, **kw)


def _compiler(args):
    from shared.rpc import compiler_pb2 as pb, compiler_pb2_grpc as pb_grpc
    from tooltrie.client import bearer, open_channel
    stub = pb_grpc.CompilerServiceStub(open_channel(args.compiler))
    return pb, _Authorized(stub, bearer(args.token))


def _print_versions(versions, as_json: bool) -> None:
    from google.protobuf.json_format import MessageToDict
    if as_json:
        print(json.dumps([MessageToDict(v, preserving_proto_field_name=True) for v in versions], indent=2))
        return
    for v in versions:
        mark = "*" if v.latest else " "
        print(f"{mark} {v.name} v{v.version}  tools={v.stats.tools} nodes={v.stats.nodes} "
              f"bytes={v.stats.bytes} const={'yes' if v.stats.fits_constant_memory else 'no'} "
              f"hash={v.content_hash[:12]}")


def cmd_publish(args) -> int:
    pb, stub = _compiler(args)
    registry = _read(args.file)
    try:
        before = stub.GetCatalog(pb.GetCatalogRequest(name=args.name), timeout=args.timeout).version.version
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.NOT_FOUND:
            raise
        before = 0
    reply = stub.Publish(pb.PublishRequest(name=args.name, registry_json=registry), timeout=args.timeout)
    v = reply.version.version
    if reply.created:
        print(f"published: {args.name} v{v} ({reply.version.stats.tools} tools)")
    elif before in (0, v):
        print(f"unchanged: {args.name} v{v} ({reply.version.stats.tools} tools)")
    else:   # identical to an older version: publishing it made that version the latest again
        print(f"unchanged: identical to {args.name} v{v}, which is the latest again (was v{before}; "
              f"`tooltrie rollback {args.name} {before}` undoes it)")
    return 0


def cmd_catalogs(args) -> int:
    pb, stub = _compiler(args)
    _print_versions(stub.ListCatalogs(pb.ListCatalogsRequest(), timeout=args.timeout).latest, args.json)
    return 0


def cmd_versions(args) -> int:
    pb, stub = _compiler(args)
    _print_versions(stub.ListVersions(pb.ListVersionsRequest(name=args.name), timeout=args.timeout).versions,
                    args.json)
    return 0


def cmd_rollback(args) -> int:
    pb, stub = _compiler(args)
    reply = stub.SetLatest(pb.SetLatestRequest(name=args.name, version=args.version), timeout=args.timeout)
    print(f"latest: {args.name} v{reply.version.version}")
    return 0


def cmd_delete(args) -> int:
    pb, stub = _compiler(args)
    reply = stub.Delete(pb.DeleteRequest(name=args.name), timeout=args.timeout)
    print(f"deleted: {args.name} ({reply.versions} version{'s' * (reply.versions != 1)})")
    return 0


def cmd_learn(args) -> int:
    pb, stub = _compiler(args)
    reply = stub.Learn(pb.LearnRequest(name=args.name), timeout=args.timeout)
    v = reply.version.version
    if reply.created:
        print(f"learned: {args.name} v{v}, {reply.examples_added} examples added from feedback "
              f"(`tooltrie rollback {args.name} <previous>` undoes it)")
    else:
        print(f"unchanged: {args.name} v{v} (no feedback it does not already have)")
    return 0


def _print_answer_json(tools, done) -> None:
    """The answer as one JSON object: each tool with its definition (description, input schema), then the
    timings; what a script calling the tools it found reads."""
    from dataclasses import asdict

    from google.protobuf.json_format import MessageToDict
    print(json.dumps({"tools": [asdict(t) for t in tools],
                      "done": MessageToDict(done, preserving_proto_field_name=True)}, indent=2, ensure_ascii=False))


def cmd_discover(args) -> int:
    from tooltrie.client import DecoderClient
    with DecoderClient(args.decoder, timeout=args.timeout) as client:
        answer = client.discover(args.catalog, args.intent, args.k, args.version, args.allow, shortlist=args.shortlist,
                                 retrieve_only=args.retrieve_only, include_definitions=args.json, decode=args.decode,
                                 min_confidence=args.min_confidence)
        if args.json:
            _print_answer_json(list(answer), client.done)
            return 0
        for tool in answer:
            print(f"{tool.index + 1}. {tool.name}  (confidence {tool.confidence:.2f}, logprob {tool.logprob:.3f}, "
                  f"retrieval rank {tool.retrieval_rank + 1}, "
                  f"{tool.catalog} v{tool.version})", flush=True)
        d = client.done
        if d.cut:
            print(f"   {d.cut} of the {args.k} below confidence {args.min_confidence:g}, left out")
        if d.stage == "retrieval":
            print(f"   chosen by retrieval in {d.retrieval_ms:.0f} ms (the generator cannot change this answer here; "
                  "--decode runs it anyway)")
        elif d.stage == "reader":
            print(f"   chosen by the reader over retrieval's shortlist: retrieval {d.retrieval_ms:.0f} ms, reading "
                  f"{d.prefill_ms:.0f} ms (--retrieve-only skips it, --decode runs the selector)")
        else:
            print(f"   prompt {d.prompt_tokens} tokens, {d.generated_tokens} generated; retrieval "
                  f"{d.retrieval_ms:.0f} ms, queue {d.queue_ms:.0f} ms, prefill {d.prefill_ms:.0f} ms, "
                  f"decode {d.decode_ms:.0f} ms")
    return 0


def cmd_mcp(args) -> int:
    """An MCP server over the decoder (and, with --upstream, a gateway over other MCP servers) until stopped."""
    import logging

    import anyio

    from tooltrie.gateway import UpstreamConfigError, read_upstreams
    from tooltrie.mcp_server import parse_http_address, serve
    try:
        upstreams = read_upstreams(args.upstream) if args.upstream else None
        http = parse_http_address(args.http) if args.http else None
    except (UpstreamConfigError, ValueError) as e:
        return _fail(str(e), EXIT_BAD_INPUT)
    logging.basicConfig(level=logging.INFO, format="tooltrie mcp: %(message)s")   # stderr: stdout is MCP's
    logging.getLogger("httpx2").setLevel(logging.WARNING)   # a line per request to an HTTP upstream otherwise
    anyio.run(serve, args.catalog, args.decoder, args.compiler, args.token, upstreams, http, Settings())
    return 0


def cmd_env(args) -> int:
    """Every setting: its variable, its value here (secrets shown as set or not) and what it means."""
    import os

    from shared.config import ENV_VARS
    secret = ("_TOKEN", "_SIGNING_KEY")   # the bearer tokens and the HMAC key; TOOLTRIE_KV_TOKENS is a size
    for name, (default, meaning) in ENV_VARS.items():
        value = os.environ.get(name, default)
        if name.endswith(secret) and value:
            value = "(set)"
        elif "REDIS_URL" in name and "@" in value:   # a password in the URL
            value = value.split("://", 1)[0] + "://(credentials)@" + value.rsplit("@", 1)[1]
        print(f"{name}={value}\n    {meaning}")
    return 0


def parser() -> argparse.ArgumentParser:
    settings = Settings()
    p = argparse.ArgumentParser(prog="tooltrie", description=__doc__.splitlines()[0])
    p.add_argument("--compiler", default=settings.compiler_addr, help="compiler service host:port")
    p.add_argument("--decoder", default=settings.decoder_addr, help="decoder service host:port")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per call")
    p.add_argument("--token", default=settings.publish_token,
                   help="bearer token for publish, rollback, delete, learn and blob reads "
                   "(default: TOOLTRIE_PUBLISH_TOKEN)")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compile", help="compile a registry locally and print its stats (no servers)")
    c.add_argument("file", help="registry JSON file, or - for stdin")
    c.add_argument("--model", default=str(settings.model_dir), help="model directory (for its tokenizer)")
    c.add_argument("--json", action="store_true", help="print the stats as JSON")
    c.add_argument("--out", help="also write the trie blob (safetensors) here")
    c.set_defaults(run=cmd_compile)

    c = sub.add_parser("publish", help="compile and publish a registry as the next version of a catalog")
    c.add_argument("file")
    c.add_argument("--name", required=True)
    c.set_defaults(run=cmd_publish)

    c = sub.add_parser("catalogs", help="list catalogs and their latest versions")
    c.add_argument("--json", action="store_true")
    c.set_defaults(run=cmd_catalogs)

    c = sub.add_parser("versions", help="list the stored versions of a catalog")
    c.add_argument("name")
    c.add_argument("--json", action="store_true")
    c.set_defaults(run=cmd_versions)

    c = sub.add_parser("discover", help="ask the decoder for k tools for an intent (streamed)")
    c.add_argument("intent")
    c.add_argument("-k", type=int, default=1)
    c.add_argument("--catalog", required=True)
    c.add_argument("--version", type=int, default=0, help="0: the latest loaded version")
    c.add_argument("--allow", nargs="*", help="only these tool names may be returned")
    c.add_argument("--shortlist", type=int, default=0, help="tools retrieved into the prompt (0: the server's default)")
    c.add_argument("--retrieve-only", action="store_true", help="the shortlist's first k, no generator")
    c.add_argument("--decode", action="store_true", help="run the generator even where it cannot change the answer")
    c.add_argument("--min-confidence", type=float, default=0.0,
                   help="only the tools whose confidence reaches this (0 to 1; default 0: exactly k)")
    c.add_argument("--json", action="store_true",
                   help="print the answer as JSON, each tool with its description and input schema")
    c.set_defaults(run=cmd_discover)

    c = sub.add_parser("mcp", help="serve MCP (stdio, or streamable HTTP): search_tools over a catalog; with "
                       "--upstream, a gateway publishing other MCP servers' tools and running call_tool")
    c.add_argument("--catalog", required=True, help="the catalog to search (in gateway mode: the one it publishes)")
    c.add_argument("--http", metavar="HOST:PORT", help="serve streamable HTTP at http://HOST:PORT/mcp (default: stdio)")
    c.add_argument("--upstream", metavar="FILE", help='gateway mode: the MCP servers of FILE ({"mcpServers": '
                   '{NAME: {"command", "args", "env"} | {"url"}}}) published as the catalog, call_tool run on them')
    c.set_defaults(run=cmd_mcp)

    c = sub.add_parser("env", help="list every setting (environment variable), its value here and meaning")
    c.set_defaults(run=cmd_env)

    c = sub.add_parser("rollback", help="make an older stored version the latest")
    c.add_argument("name")
    c.add_argument("version", type=int)
    c.set_defaults(run=cmd_rollback)

    c = sub.add_parser("learn", help="publish the next version of a catalog with the feedback its tools were "
                       "chosen for as examples (Feedback RPC; the MCP gateway sends it)")
    c.add_argument("name")
    c.set_defaults(run=cmd_learn)

    c = sub.add_parser("delete", help="delete a catalog, every stored version (decoders stop serving it)")
    c.add_argument("name")
    c.set_defaults(run=cmd_delete)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except InputError as e:
        return _fail(str(e), EXIT_BAD_INPUT)
    except grpc.RpcError as e:
        code = EXIT_BAD_INPUT if e.code() == grpc.StatusCode.INVALID_ARGUMENT else EXIT_FAILED
        return _fail(f"{e.code().name}: {e.details()}", code)


if __name__ == "__main__":
    sys.exit(main())

"""`tooltrie mcp`: an MCP server whose search_tools asks the decoder for a catalog's k best tools, and whose
call_tool runs one on the upstream server that owns it (gateway mode, tooltrie/gateway.py).

It speaks MCP over stdio (an MCP client starts it as a command) or streamable HTTP (`--http HOST:PORT`, the
endpoint at /mcp), and reaches the decoder and the compiler over gRPC with the settings every client uses
(addresses, TLS, the discover and publish tokens).
"""
from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import grpc
import mcp_types as types
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from typing_extensions import TypedDict   # typing's TypedDict: not for pydantic on Python < 3.12

from shared.config import Settings
from shared.rpc import compiler_pb2 as cpb, compiler_pb2_grpc as cpb_grpc
from tooltrie.client import AsyncDecoderClient, bearer, open_channel
from tooltrie.gateway import Gateway, GatewayError, Upstream

log = logging.getLogger("tooltrie.mcp")
INSTRUCTIONS = ("Find tools with search_tools (a request in your own words; the k best tools come back best first, "
                "each with its input schema); in gateway mode, run one with call_tool.")
# search_tools leaves out tools below this calibrated confidence (a caller may pass another; 0: always k; chosen in
# docs/quality.md, "Confidence")
MIN_CONFIDENCE = 0.2
SEARCHES_KEPT = 1024   # tools of recent answers remembered, so that calling one sends the search's query as feedback


class FoundTool(TypedDict):
    """One tool of a search_tools answer."""
    rank: int                       # its place in the answer, 1 = best
    name: str
    description: str
    input_schema: dict[str, Any] | None   # None when its registry gave none
    retrieval_score: float          # the first stage's fused score (higher is better)
    confidence: float               # calibrated chance, in [0, 1], that it fits the request (never above the one
                                    # ranked before it)


class SearchResult(TypedDict):
    catalog: str
    version: int                    # the catalog version that answered
    tools: list[FoundTool]
    cut: int                        # how many of the k fell below min_confidence


def _found(tool) -> FoundTool:
    return {"rank": tool.index + 1, "name": tool.name, "description": tool.description,
            "input_schema": tool.input_schema, "retrieval_score": tool.retrieval_score,
            "confidence": round(tool.confidence, 4)}


def build_server(catalog: str, decoder: AsyncDecoderClient, gateway: Gateway | None,
                 feedback: Callable[[int, str, str], Awaitable[None]] | None = None) -> MCPServer:
    """The MCP server's two tools over one catalog; call_tool runs tools only with a gateway, and sends
    `feedback(version, query, tool)` when the tool it runs was in a search's answer."""
    server = MCPServer("tooltrie", instructions=INSTRUCTIONS)
    searched: OrderedDict[str, tuple[int, str]] = OrderedDict()   # tool -> (version, query) of its latest answer

    @server.tool()
    async def search_tools(query: str, k: int = 5, min_confidence: float = MIN_CONFIDENCE) -> SearchResult:
        """Find up to k tools that fit a request, best first, each with its description, full input schema and
        confidence (0 to 1), ready to call. Tools below min_confidence are left out (0: always k)."""
        try:
            found = [t async for t in decoder.discover(catalog, query, k, include_definitions=True,
                                                       min_confidence=min_confidence)]
        except grpc.aio.AioRpcError as e:
            raise ToolError(f"the decoder refused the search ({e.code().name}): {e.details()}") from None
        version = found[0].version if found else decoder.accepted.version
        for t in found:
            searched[t.name] = (version, query)
            searched.move_to_end(t.name)
        while len(searched) > SEARCHES_KEPT:
            searched.popitem(last=False)
        return {"catalog": catalog, "version": version, "tools": [_found(t) for t in found], "cut": k - len(found)}

    @server.tool()
    async def call_tool(name: str, arguments: dict[str, Any]) -> types.CallToolResult:
        """Run a tool that search_tools found, with arguments that match its input schema; returns the tool's
        own result."""
        if gateway is None:
            raise ToolError("call_tool runs tools only in gateway mode (`tooltrie mcp --upstream FILE`); "
                            "this server searches the catalog: call the tool where it is served")
        try:
            result = await gateway.call(name, arguments)
        except GatewayError as e:
            raise ToolError(str(e)) from None
        if feedback is not None and name in searched:
            await feedback(*searched[name], name)
        return result

    return server


class CatalogPublisher:
    """Publishes a registry as the next version of one catalog through the compiler's Publish RPC (the latest
    version again when identical), with the publish token, as `tooltrie publish` does; sends Feedback for it."""

    def __init__(self, compiler_addr: str, catalog: str, token: str, settings: Settings):
        self.catalog = catalog
        self.stub = cpb_grpc.CompilerServiceStub(open_channel(compiler_addr, settings, aio=True))
        self.metadata = bearer(token)

    async def __call__(self, registry: dict) -> int:
        request = cpb.PublishRequest(name=self.catalog, registry_json=json.dumps(registry, ensure_ascii=False))
        try:
            reply = await self.stub.Publish(request, timeout=60, metadata=self.metadata)
        except grpc.aio.AioRpcError as e:   # one line, as the CLI says it
            raise RuntimeError(f"{e.code().name}: {e.details()}") from None
        return reply.version.version

    async def feedback(self, version: int, intent: str, tool: str) -> None:
        """Tell the compiler that `tool` was called for `intent` (what `tooltrie learn` turns into examples); a
        failure is logged, never the call's."""
        request = cpb.FeedbackRequest(name=self.catalog, version=version, intent=intent, tools=[tool])
        try:
            await self.stub.Feedback(request, timeout=5, metadata=self.metadata)
        except grpc.aio.AioRpcError as e:
            log.warning("feedback for %r not kept: %s: %s", tool, e.code().name, e.details())


def parse_http_address(address: str) -> tuple[str, int]:
    """HOST:PORT for --http, refused with a ValueError that says what is expected."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--http expects HOST:PORT (say 127.0.0.1:8765), got {address!r}")
    return host.strip("[]"), int(port)


async def serve(catalog: str, decoder_addr: str, compiler_addr: str, publish_token: str,
                upstreams: list[Upstream] | None, http: tuple[str, int] | None, settings: Settings) -> None:
    """Serve MCP until the client goes (stdio) or the process is stopped; the gateway, when there are upstreams,
    runs beside it in the same event loop and ends with it."""
    decoder = AsyncDecoderClient(decoder_addr, settings=settings)
    gateway = publisher = None
    if upstreams:
        publisher = CatalogPublisher(compiler_addr, catalog, publish_token, settings)
        gateway = Gateway(upstreams, publisher)
    server = build_server(catalog, decoder, gateway, publisher.feedback if publisher else None)
    async with anyio.create_task_group() as tg:
        if gateway is not None:
            tg.start_soon(gateway.run)
        if http is None:
            await server.run_stdio_async()
        else:
            log.info("MCP over streamable HTTP on http://%s:%d/mcp", *http)
            await server.run_streamable_http_async(host=http[0], port=http[1])
        tg.cancel_scope.cancel()
    await decoder.close()

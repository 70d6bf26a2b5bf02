"""An upstream MCP server for the gateway tests, run as its own process over stdio or streamable HTTP.

`python tests/mcp_upstream.py NAME TOOLS.json [--http PORT]` serves the tools of TOOLS.json (MCP tools/list
entries); each answers with its server's name, its own and its arguments, or an error result when a required
argument is missing. Two more tools drive the tests: `add_tool` adds a tool and announces the change (as a
`subscriptions/listen` event and as `notifications/tools/list_changed`, whichever era the client speaks), and
`exit` ends the process, as a crash would.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import anyio
import mcp_types as types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler, ToolsListChanged

CONTROL_TOOLS = [
    {"name": "add_tool", "description": "Add a tool to this server",
     "inputSchema": {"type": "object", "properties": {"name": {"type": "string"}, "description": {"type": "string"}},
                     "required": ["name", "description"]}},
    {"name": "exit", "description": "End this server's process", "inputSchema": {"type": "object"}},
]


def text_result(text: str, is_error: bool = False, structured: dict | None = None) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], structured_content=structured,
                                is_error=is_error)


def build(name: str, tools: list[dict]) -> Server:
    """The server: its tools, the answers, and the two control tools."""
    tools = [*tools, *CONTROL_TOOLS]
    bus = InMemorySubscriptionBus()

    async def list_tools(ctx, params) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[types.Tool.model_validate(t) for t in tools])

    async def call_tool(ctx, params) -> types.CallToolResult:
        arguments = params.arguments or {}
        tool = next((t for t in tools if t["name"] == params.name), None)
        if tool is None:
            return text_result(f"no tool {params.name!r} on {name}", is_error=True)
        if params.name == "exit":
            os._exit(3)
        missing = [a for a in tool["inputSchema"].get("required", []) if a not in arguments]
        if missing:
            return text_result(f"{params.name}: missing argument {missing[0]!r}", is_error=True)
        if params.name == "add_tool":
            tools.insert(0, {"name": arguments["name"], "description": arguments["description"],
                             "inputSchema": {"type": "object", "properties": {"q": {"type": "string"}}}})
            await bus.publish(ToolsListChanged())
            await ctx.session.send_tool_list_changed()   # dropped by the SDK on a 2026 connection
        return text_result(f"{name}/{params.name} {json.dumps(arguments, sort_keys=True)}",
                           structured={"server": name, "tool": params.name, "arguments": arguments})

    return Server(name, on_list_tools=list_tools, on_call_tool=call_tool, on_subscriptions_listen=ListenHandler(bus))


async def serve(server: Server, http_port: int | None) -> None:
    if http_port is None:
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())
        return
    import uvicorn
    config = uvicorn.Config(server.streamable_http_app(), host="127.0.0.1", port=http_port, log_level="warning")
    await uvicorn.Server(config).serve()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("name")
    p.add_argument("tools", help="JSON file: a list of MCP tools (name, description, inputSchema)")
    p.add_argument("--http", type=int, help="serve streamable HTTP on this loopback port (default: stdio)")
    args = p.parse_args()
    server = build(args.name, json.loads(Path(args.tools).read_text()))
    anyio.run(serve, server, args.http)


if __name__ == "__main__":
    main()

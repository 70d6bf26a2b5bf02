"""Gateway mode of `tooltrie mcp`: upstream MCP servers' tools published as one catalog, each call run on its owner.

Each upstream (a command over stdio, or a streamable HTTP URL) is followed by a task of its own: it connects,
lists the tools, relists them when the server says they changed (`notifications/tools/list_changed`, or an event
of a `subscriptions/listen` stream on a 2026 connection) and reconnects after any failure. Whenever the union of
the lists changes, it is published as the next version of the catalog (a normal publish: the decoder hot-swaps
it). A tool name that several upstreams share is published as `server__tool`. A dead upstream keeps its last
listed tools in the catalog; calling one of them is a clear error until it is back, and the others never notice.
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import mcp_types as types
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

log = logging.getLogger("tooltrie.gateway")
PREFIX_SEPARATOR = "__"
MAX_LIST_PAGES = 100


class UpstreamConfigError(ValueError):
    """The upstream file cannot be used; the message says which server and why."""


class GatewayError(Exception):
    """A call the gateway cannot run: no such tool, or its upstream is down or failed; the message says which."""


@dataclass
class Upstream:
    """One upstream MCP server: how to reach it, its last tool listing and, while connected, its session."""
    name: str
    target: StdioServerParameters | str          # a command over stdio, or a streamable HTTP URL
    tools: list[types.Tool] = field(default_factory=list)
    client: Client | None = None                 # None while it is down
    error: str = "not connected yet"             # why it is down
    tried: anyio.Event = field(default_factory=anyio.Event)        # set once its first connection ended or listed
    list_changed: anyio.Event = field(default_factory=anyio.Event)


def read_upstreams(path: str | Path) -> list[Upstream]:
    """The servers of an MCP client config file, `{"mcpServers": {NAME: {"command", "args", "env"} | {"url"}}}`,
    checked before anything starts, so that a typo is one clear error rather than a server that never shows up."""
    try:
        servers = json.loads(Path(path).read_text(encoding="utf-8")).get("mcpServers")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise UpstreamConfigError(f"cannot read {path} as an MCP client config: {e}") from None
    if not isinstance(servers, dict) or not servers:
        raise UpstreamConfigError(f'{path}: expected {{"mcpServers": {{NAME: {{"command": ...}} or {{"url": ...}}}}}}')
    upstreams = []
    for name, spec in servers.items():
        if PREFIX_SEPARATOR in name or not name.strip():
            raise UpstreamConfigError(f"{path}: server name {name!r} is empty or contains {PREFIX_SEPARATOR!r}")
        if not isinstance(spec, dict) or ("url" in spec) == ("command" in spec):
            raise UpstreamConfigError(f"{path}: server {name!r} needs either a 'command' or a 'url'")
        if "url" in spec:
            if not isinstance(spec["url"], str) or not spec["url"].startswith(("http://", "https://")):
                raise UpstreamConfigError(f"{path}: server {name!r}: url must be an http(s) URL")
            upstreams.append(Upstream(name, spec["url"]))
            continue
        args, env = spec.get("args", []), spec.get("env")
        if (not isinstance(spec["command"], str) or not isinstance(args, list)
                or not all(isinstance(a, str) for a in args)
                or (env is not None and not (isinstance(env, dict) and all(isinstance(v, str) for v in env.values())))):
            raise UpstreamConfigError(f"{path}: server {name!r}: command must be a string, args a list of strings "
                                      "and env an object of strings")
        upstreams.append(Upstream(name, StdioServerParameters(command=spec["command"], args=args, env=env)))
    return upstreams


def published_names(upstreams: list[Upstream]) -> dict[str, tuple[Upstream, types.Tool]]:
    """Each name the catalog publishes, with the upstream and tool it stands for: a name several upstreams share
    is prefixed by its server's name (`server__tool`), so that every published name calls one tool."""
    shared = Counter(t.name for u in upstreams for t in u.tools)
    return {(f"{u.name}{PREFIX_SEPARATOR}{t.name}" if shared[t.name] > 1 else t.name): (u, t)
            for u in upstreams for t in u.tools}


def _reason(error: BaseException) -> str:
    """One line for why a connection failed: the first leaf of an exception group, named by its type."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


class Gateway:
    """Follows the upstreams, publishes the union of their tools with `publish` (a coroutine taking an MCP
    tools/list registry, returning the version) whenever it changes, and runs calls on the tools' owners."""

    def __init__(self, upstreams: list[Upstream], publish: Callable[[dict], Awaitable[int]],
                 retry_seconds: float = 1.0, startup_seconds: float = 10.0, ping_seconds: float = 5.0,
                 call_timeout_seconds: float = 60.0, republish_seconds: float = 10.0):
        self.upstreams = upstreams
        self.routes: dict[str, tuple[Upstream, types.Tool]] = {}
        self._publish = publish
        self._published: dict | None = None
        self._union_changed = anyio.Event()
        self.retry_seconds, self.startup_seconds = retry_seconds, startup_seconds
        self.ping_seconds, self.call_timeout_seconds = ping_seconds, call_timeout_seconds
        self.republish_seconds = republish_seconds

    async def run(self) -> None:
        """Until cancelled: follow every upstream; publish the union once each has been tried (or after
        startup_seconds), then again at every change, and every republish_seconds while a publish fails (the
        compiler may be restarting)."""
        async with anyio.create_task_group() as tg:
            for upstream in self.upstreams:
                tg.start_soon(self._follow, upstream)
            with anyio.move_on_after(self.startup_seconds):
                for upstream in self.upstreams:
                    await upstream.tried.wait()
            while True:
                self._union_changed = anyio.Event()
                published = await self._publish_union()
                with anyio.move_on_after(None if published else self.republish_seconds):
                    await self._union_changed.wait()

    async def call(self, name: str, arguments: dict) -> types.CallToolResult:
        """The result of the published tool `name` run on its upstream, as that server returned it."""
        route = self.routes.get(name)
        if route is None:
            raise GatewayError(f"no tool {name!r} on any upstream server (search_tools finds the "
                               f"{len(self.routes)} there are)")
        upstream, tool = route
        client = upstream.client
        if client is None:
            raise GatewayError(f"upstream server {upstream.name!r}, which serves {name!r}, is down "
                               f"({upstream.error}); the gateway reconnects every {self.retry_seconds:g} s")
        try:
            return await client.call_tool(tool.name, arguments, read_timeout_seconds=self.call_timeout_seconds)
        except (MCPError, anyio.ClosedResourceError, anyio.BrokenResourceError, TimeoutError) as e:
            raise GatewayError(f"upstream server {upstream.name!r} failed to run {name!r}: {_reason(e)}") from None

    async def _publish_union(self) -> bool:
        """Route calls by the current union and publish it unless it is what was published last; False when the
        publish failed (logged: the version before goes on serving)."""
        names = published_names(self.upstreams)
        self.routes = names
        registry = {"tools": [{"name": name, "description": tool.description or "", "inputSchema": tool.input_schema}
                              for name, (_, tool) in names.items()]}
        if not registry["tools"] or registry == self._published:
            return True
        try:
            version = await self._publish(registry)
        except Exception as e:  # noqa: BLE001 - any failure is reported the same way and retried
            log.error("publishing the upstreams' %d tools failed: %s", len(names), _reason(e))
            return False
        self._published = registry
        log.info("published v%d: %d tools of %d upstream servers", version, len(names), len(self.upstreams))
        return True

    async def _follow(self, upstream: Upstream) -> None:
        """Keep one upstream connected and its listing current, reconnecting after any failure."""
        async def on_message(message) -> None:
            if isinstance(message, types.ToolListChangedNotification):
                upstream.list_changed.set()

        reported = ""
        while True:
            try:
                async with Client(upstream.target, message_handler=on_message, cache=None,
                                  read_timeout_seconds=self.call_timeout_seconds) as client:
                    await self._relist(upstream, client)
                    upstream.client, upstream.error, reported = client, "", ""
                    log.info("upstream %s: connected, %d tools", upstream.name, len(upstream.tools))
                    await self._watch(upstream, client)
            except Exception as e:  # noqa: BLE001 - an upstream's failure is its own: reported, retried
                upstream.error = _reason(e)
            finally:
                upstream.client = None
                upstream.tried.set()
            if upstream.error != reported:   # once per outage and cause, not at every retry
                log.warning("upstream %s is down (%s); reconnecting every %g s", upstream.name, upstream.error,
                            self.retry_seconds)
                reported = upstream.error
            await anyio.sleep(self.retry_seconds)

    async def _watch(self, upstream: Upstream, client: Client) -> None:
        """Relist at every change the upstream announces; returns (raises) when its connection fails."""
        async with anyio.create_task_group() as tg:
            if client.protocol_version in MODERN_PROTOCOL_VERSIONS:
                tg.start_soon(self._listen, upstream, client)
            else:
                tg.start_soon(self._ping, client)
            while True:
                await upstream.list_changed.wait()
                upstream.list_changed = anyio.Event()
                await self._relist(upstream, client)

    @staticmethod
    async def _listen(upstream: Upstream, client: Client) -> None:
        """A 2026 server announces changes only on a listen stream, whose end is also the connection's."""
        async with client.listen(tools_list_changed=True) as events:
            async for _ in events:
                upstream.list_changed.set()
        raise ConnectionError("the server closed its event stream")

    async def _ping(self, client: Client) -> None:
        """A 2025 connection has no stream to end with it: a ping that goes unanswered tells it is gone."""
        while True:
            await anyio.sleep(self.ping_seconds)
            with anyio.fail_after(self.ping_seconds):
                await client.send_ping()

    async def _relist(self, upstream: Upstream, client: Client) -> None:
        tools, cursor = [], None
        for _ in range(MAX_LIST_PAGES):
            page = await client.list_tools(cursor=cursor)
            tools += page.tools
            cursor = page.next_cursor
            if not cursor:
                break
        upstream.tools = tools
        self._union_changed.set()

"""`tooltrie mcp` and full tool definitions, with real processes and protocols: a real Redis, the compiler and the
decoder (a tiny model on the CPU, test_e2e's Stack), `tooltrie mcp` as a command over stdio and on streamable HTTP,
upstream MCP servers (tests/mcp_upstream.py, over stdio and HTTP), each reached through a real MCP client session."""
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import anyio
import grpc
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters

from devstack.redis_server import free_port
from devstack.stack import wait_serving
from model_fixtures import make_serving_model
from shared.rpc import compiler_pb2 as pb, compiler_pb2_grpc as pb_grpc
from shared.trie import Trie
from test_e2e import Stack, wait_health
from tooltrie import cli
from tooltrie.client import DecoderClient

UPSTREAM = Path(__file__).with_name("mcp_upstream.py")


def tool(name, description, **properties):
    """An MCP tools/list entry whose arguments are all required strings."""
    return {"name": name, "description": description,
            "inputSchema": {"type": "object", "properties": {p: {"type": "string", "description": d}
                                                             for p, d in properties.items()},
                            "required": list(properties)}}


DEMO = [tool("get_weather", "Current weather and forecast for a city", city="the city's name"),
        tool("book_flight", "Book a flight between two airports", origin="IATA code", destination="IATA code"),
        tool("convert_currency", "Convert an amount between currencies", amount="a number", to="ISO code"),
        {"name": "tell_joke", "description": "Tell a short joke"}]
WEATHER = [tool("get_weather", "Current weather and forecast for a city", city="the city's name")]
FILES = [tool("read_file", "Read a text file of the project", path="relative path")]
FILES_AGAIN = [tool("write_file", "Write a text file of the project", path="relative path", text="its content")]


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, small_tokenizer_dir, redis_url):
    """The compiler and the decoder on a namespace of the test run's Redis, the demo registry (an MCP tools/list
    result) published as `demo` and served."""
    model = make_serving_model(tmp_path_factory.mktemp("model"), small_tokenizer_dir)
    s = Stack(tmp_path_factory.mktemp("stack"), model, redis_url=redis_url, namespace=f"mcp-{uuid.uuid4().hex[:8]}")
    s.publish({"tools": DEMO}, name="demo")
    wait_health(s.decoder_addr, s.decoder)
    yield s
    s.stop()


def tooltrie_mcp(stack, *args) -> list[str]:
    """The command line of `tooltrie mcp` against the stack."""
    return [sys.executable, "-m", "tooltrie.cli", "--decoder", stack.decoder_addr, "--compiler", stack.compiler_addr,
            "mcp", *args]


def upstream_http(tmp_path, name, tools, port) -> subprocess.Popen:
    """An upstream MCP server on streamable HTTP, its own process."""
    spec = tmp_path / f"{name}-{uuid.uuid4().hex[:6]}.json"
    spec.write_text(json.dumps(tools))
    return subprocess.Popen([sys.executable, str(UPSTREAM), name, str(spec), "--http", str(port)])


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


async def search(client, query, k, min_confidence=0.0) -> dict:
    result = await client.call_tool("search_tools", {"query": query, "k": k, "min_confidence": min_confidence})
    assert not result.is_error, result.content[0].text
    assert json.loads(result.content[0].text) == result.structured_content   # the same answer as text
    return result.structured_content


async def eventually(probe, timeout, what):
    """probe()'s first truthy value within timeout seconds, and the seconds it took."""
    started, last_error = time.monotonic(), None
    while True:
        try:
            value = await probe()
        except Exception as e:  # noqa: BLE001 - not there yet (a server starting, a catalog not published yet)
            value, last_error = None, e
        if value:
            return value, time.monotonic() - started
        assert time.monotonic() - started < timeout, f"timed out waiting for {what} (last error: {last_error!r})"
        await anyio.sleep(0.05)


def test_an_mcp_tools_list_comes_back_with_its_input_schemas(stack, capsys):
    schemas = {t["name"]: t.get("inputSchema") for t in DEMO}
    with DecoderClient(stack.decoder_addr) as client:
        found = list(client.discover("demo", "weather in Paris", k=4, include_definitions=True))
        plain = list(client.discover("demo", "weather in Paris", k=4))
    assert {t.name: t.input_schema for t in found} == schemas
    assert {t.name: t.description for t in found} == {t["name"]: t["description"] for t in DEMO}
    assert all(t.input_schema is None and t.description == "" for t in plain)   # only when asked for

    assert cli.main(["--decoder", stack.decoder_addr, "discover", "book a flight", "-k", "2", "--catalog", "demo",
                     "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [t["input_schema"] for t in printed["tools"]] == [schemas[t["name"]] for t in printed["tools"]]
    assert printed["done"]["stage"] == "reader"   # the tiny model was tuned on no catalog: its reader answers


def test_openai_parameters_are_kept_as_the_input_schema(stack):
    functions = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                   "parameters": t.get("inputSchema")}} for t in DEMO[:2]]
    stack.publish(functions, name="openai")
    wait_serving(stack.decoder_addr, 60, stack.decoder, service="tooltrie.catalog.openai")
    with DecoderClient(stack.decoder_addr) as client:
        found = list(client.discover("openai", "a flight", k=2, retrieve_only=True, include_definitions=True))
    assert {t.name: t.input_schema for t in found} == {t["name"]: t["inputSchema"] for t in DEMO[:2]}


@pytest.mark.parametrize("schema, message", [
    ({"type": "object", "description": "x" * 20_000}, "characters of JSON, over the limit of 20000"),
    (["not", "an", "object"], "inputSchema must be a JSON object, got list"),
])
def test_a_bad_input_schema_is_one_clear_error_and_stores_nothing(stack, tmp_path, capsys, schema, message):
    registry = tmp_path / "registry.json"
    registry.write_text(json.dumps({"tools": [*DEMO[:3], {"name": "bad_tool", "inputSchema": schema}]}))
    assert cli.main(["--compiler", stack.compiler_addr, "versions", "demo", "--json"]) == 0
    before = capsys.readouterr().out
    assert cli.main(["--compiler", stack.compiler_addr, "publish", str(registry), "--name", "demo"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "INVALID_ARGUMENT" in err[0] and "tool #3 ('bad_tool')" in err[0] and message in err[0]
    assert cli.main(["--compiler", stack.compiler_addr, "versions", "demo", "--json"]) == 0
    assert capsys.readouterr().out == before


@pytest.mark.anyio
async def test_over_stdio_search_tools_answers_with_definitions_and_call_tool_needs_a_gateway(stack):
    command = tooltrie_mcp(stack, "--catalog", "demo")
    async with Client(StdioServerParameters(command=command[0], args=command[1:]), cache=None) as client:
        assert {t.name for t in (await client.list_tools()).tools} == {"search_tools", "call_tool"}
        answer = await search(client, "what's the weather in Paris", 2)
        assert answer["catalog"] == "demo" and answer["version"] >= 1 and len(answer["tools"]) == 2
        assert answer["cut"] == 0
        by_name = {t["name"]: t for t in DEMO}
        for rank, found in enumerate(answer["tools"], 1):
            assert found["rank"] == rank and isinstance(found["retrieval_score"], float)
            assert found["description"] == by_name[found["name"]]["description"]
            assert found["input_schema"] == by_name[found["name"]].get("inputSchema")
            assert 0.0 <= found["confidence"] <= 1.0
        assert answer["tools"][0]["confidence"] >= answer["tools"][1]["confidence"]
        none = await search(client, "what's the weather in Paris", 2, min_confidence=1.0)
        assert none["tools"] == [] and none["cut"] == 2 and none["version"] == answer["version"]

        refused = await client.call_tool("call_tool", {"name": "get_weather", "arguments": {"city": "Paris"}})
        assert refused.is_error and "only in gateway mode" in refused.content[0].text
        bad_k = await client.call_tool("search_tools", {"query": "weather", "k": 0})
        assert bad_k.is_error and "INVALID_ARGUMENT" in bad_k.content[0].text


@pytest.fixture(scope="module")
def gateway(stack, tmp_path_factory):
    """`tooltrie mcp --upstream` on streamable HTTP over two upstreams: `weather` (stdio, the gateway starts it)
    and `files` (HTTP, started here, so that a test can stop it and start it again with another list)."""
    tmp = tmp_path_factory.mktemp("gateway")
    (tmp / "weather.json").write_text(json.dumps(WEATHER))
    files_port, port = free_port(), free_port()
    config = {"mcpServers": {"weather": {"command": sys.executable,
                                         "args": [str(UPSTREAM), "weather", str(tmp / "weather.json")]},
                             "files": {"url": f"http://127.0.0.1:{files_port}/mcp"}}}
    (tmp / "upstreams.json").write_text(json.dumps(config))
    files = upstream_http(tmp, "files", FILES, files_port)
    proc = subprocess.Popen(tooltrie_mcp(stack, "--catalog", "gateway", "--upstream", str(tmp / "upstreams.json"),
                                         "--http", f"127.0.0.1:{port}"), stderr=(tmp / "gateway.log").open("w"))
    state = {"url": f"http://127.0.0.1:{port}/mcp", "files": files, "files_port": files_port, "tmp": tmp}
    yield state
    stop(proc)
    stop(state["files"])


async def names_found(url, k) -> set[str]:
    async with Client(url, cache=None) as client:
        return {t["name"] for t in (await search(client, "tools", k))["tools"]}


@pytest.mark.anyio
async def test_the_gateway_publishes_the_union_and_returns_the_owners_results(gateway):
    union = {"get_weather", "read_file", "weather__add_tool", "files__add_tool", "weather__exit", "files__exit"}
    found, _ = await eventually(lambda: names_found(gateway["url"], 6), 90, "the union published and served")
    assert found == union   # add_tool and exit are on both servers: prefixed by their server's name

    async with Client(gateway["url"], cache=None) as client:
        assert {t.name for t in (await client.list_tools()).tools} == {"search_tools", "call_tool"}
        result = await client.call_tool("call_tool", {"name": "get_weather", "arguments": {"city": "Paris"}})
        assert not result.is_error and result.content[0].text == 'weather/get_weather {"city": "Paris"}'
        assert result.structured_content == {"server": "weather", "tool": "get_weather", "arguments": {"city": "Paris"}}
        result = await client.call_tool("call_tool", {"name": "read_file", "arguments": {"path": "README.md"}})
        assert result.content[0].text == 'files/read_file {"path": "README.md"}'

        missing = await client.call_tool("call_tool", {"name": "get_weather", "arguments": {}})
        assert missing.is_error and missing.content[0].text == "get_weather: missing argument 'city'"  # the upstream's
        unknown = await client.call_tool("call_tool", {"name": "get_tides", "arguments": {}})
        assert unknown.is_error and "no tool 'get_tides' on any upstream server" in unknown.content[0].text
        malformed = await client.call_tool("call_tool", {"name": "get_weather", "arguments": ["Paris"]})
        assert malformed.is_error and "arguments" in malformed.content[0].text


@pytest.mark.anyio
async def test_a_call_after_a_search_is_feedback_that_learn_publishes(gateway, stack, capsys):
    await eventually(lambda: names_found(gateway["url"], 6), 90, "the union published and served")
    async with Client(gateway["url"], cache=None) as client:
        await search(client, "is it sunny in Lisbon", 6)
        result = await client.call_tool("call_tool", {"name": "get_weather", "arguments": {"city": "Lisbon"}})
        assert not result.is_error
    capsys.readouterr()
    assert cli.main(["--compiler", stack.compiler_addr, "learn", "gateway"]) == 0
    assert "examples added from feedback" in capsys.readouterr().out
    with grpc.insecure_channel(stack.compiler_addr) as channel:
        blob = pb_grpc.CompilerServiceStub(channel).GetCatalog(pb.GetCatalogRequest(name="gateway",
                                                                                    include_blob=True)).blob
    trie = Trie.from_blob(blob)
    assert "is it sunny in Lisbon" in trie.meta["examples"][trie.pointer_names.index("get_weather")]


@pytest.mark.anyio
async def test_an_upstream_list_change_is_searchable_within_2_s(gateway):
    async with Client(gateway["url"], cache=None) as client:
        added = await client.call_tool("call_tool", {"name": "weather__add_tool",
                                                     "arguments": {"name": "get_tides", "description": "Tide times"}})
        assert not added.is_error, added.content[0].text
        _, seconds = await eventually(lambda: names_found_in(client, "get_tides", 7), 10, "get_tides searchable")
        assert seconds < 2.0, seconds
        result = await client.call_tool("call_tool", {"name": "get_tides", "arguments": {}})
        assert result.content[0].text == "weather/get_tides {}"


async def names_found_in(client, name, k) -> bool:
    return name in {t["name"] for t in (await search(client, "tools", k))["tools"]}


@pytest.mark.anyio
async def test_a_dead_upstream_is_a_clear_error_and_the_others_go_on(gateway):
    async with Client(gateway["url"], cache=None) as client:
        died = await client.call_tool("call_tool", {"name": "files__exit", "arguments": {}})
        assert died.is_error and "upstream server 'files' failed to run 'files__exit'" in died.content[0].text
        gateway["files"].wait(10)

        async def down():
            result = await client.call_tool("call_tool", {"name": "read_file", "arguments": {"path": "a"}})
            return result.is_error and result.content[0].text
        text, _ = await eventually(down, 10, "read_file refused")
        assert "upstream server 'files', which serves 'read_file', is down" in text
        result = await client.call_tool("call_tool", {"name": "get_weather", "arguments": {"city": "Oslo"}})
        assert not result.is_error and result.content[0].text == 'weather/get_weather {"city": "Oslo"}'
        assert await names_found_in(client, "get_weather", 7)


@pytest.mark.anyio
async def test_an_upstream_back_with_another_list_is_republished(gateway):
    gateway["files"] = upstream_http(gateway["tmp"], "files", FILES_AGAIN, gateway["files_port"])

    async def republished():
        names = await names_found(gateway["url"], 7)
        return "write_file" in names and "read_file" not in names
    await eventually(republished, 30, "write_file published in place of read_file")
    async with Client(gateway["url"], cache=None) as client:
        result = await client.call_tool("call_tool", {"name": "write_file", "arguments": {"path": "a", "text": "b"}})
        assert result.content[0].text == 'files/write_file {"path": "a", "text": "b"}'

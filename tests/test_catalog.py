"""Registries in the three shapes users have, and every bad input refused with the tool named."""
import json

import pytest

from shared.catalog import CatalogError, check_catalog_name, parse_registry
from shared.config import Settings
from tokenizer_fixtures import catalog_path

PLAIN = [{"name": "weather", "description": "Forecasts", "examples": ["rain tomorrow?"]},
         {"name": "news", "description": "Headlines"}]


def test_plain_list():
    cat = parse_registry(json.dumps(PLAIN))
    assert cat.names == ["weather", "news"]
    assert cat.tools[0].examples == ("rain tomorrow?",)


def test_mcp_tools_list_result():
    reg = {"tools": [{"name": "read_file", "description": "Read a file", "inputSchema": {"type": "object"}}]}
    assert parse_registry(json.dumps(reg)).names == ["read_file"]


def test_openai_function_tools():
    reg = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                             "parameters": {"type": "object"}}}]
    assert parse_registry(json.dumps(reg)).names == ["get_weather"]


@pytest.mark.parametrize("name", ["metatool", "bigcatalog", "toolbench"])
def test_shared_catalogs_parse(name):
    data = json.loads(catalog_path(name).read_text())
    assert parse_registry(catalog_path(name).read_text()).names == [t["name"] for t in data]


@pytest.mark.parametrize("registry, message", [
    ("{not json", "malformed JSON"),
    ("[]", "holds no tools"),
    ('{"tools": []}', "holds no tools"),
    ('"just a string"', "unknown registry shape"),
    ('{"functions": []}', "unknown registry shape"),
    ('[{"description": "no name"}]', "tool #0: expected an object with a 'name'"),
    ('[{"name": ""}]', "tool #0 (''): name is empty"),
    ('[{"name": "   "}]', "name is empty or only whitespace"),
    ('[{"name": 42}]', "name must be a string"),
    ('[{"name": "a\\u0007b"}]', "control character"),
    ('[{"name": "line\\nbreak"}]', "control character"),
    ('[{"name": "x", "description": 3}]', "description must be a string"),
    ('[{"name": "x", "examples": "one"}]', "examples must be a list"),
    ('[{"name": "dup"}, {"name": "dup"}]', "tool #1 ('dup'): name 'dup' duplicates tool #0"),
    ('[{"name": "caf\\u00e9"}, {"name": "cafe\\u0301"}]', "after Unicode normalisation"),
])
def test_bad_registries_are_refused_with_the_tool_named(registry, message):
    with pytest.raises(CatalogError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_registry(registry)


def test_limits_from_settings():
    small = Settings(max_tools=2, max_name_chars=5, max_description_chars=10, max_examples=3)
    with pytest.raises(CatalogError, match="3 tools, over the limit of 2"):
        parse_registry(json.dumps([{"name": n} for n in "abc"]), small)
    with pytest.raises(CatalogError, match="6 characters, over the limit of 5"):
        parse_registry('[{"name": "abcdef"}]', small)
    with pytest.raises(CatalogError, match="description has 11 characters"):
        parse_registry('[{"name": "a", "description": "01234567890"}]', small)
    with pytest.raises(CatalogError, match=r"tool #1 \('b'\): the registry's examples pass the limit of 3"):
        parse_registry('[{"name": "a", "examples": ["x", "y"]}, {"name": "b", "examples": ["z", "w"]}]', small)
    assert len(parse_registry('[{"name": "a", "examples": ["x", "y", "z"]}]', small).tools[0].examples) == 3


@pytest.mark.parametrize("name", ["metatool", "v2.catalog_x-1", "A"])
def test_catalog_names_accepted(name):
    assert check_catalog_name(name) == name


@pytest.mark.parametrize("name", ["", "-x", "has space", "a:b", "x" * 65, "é"])
def test_catalog_names_refused(name):
    with pytest.raises(CatalogError, match="is not valid"):
        check_catalog_name(name)

"""Tool registries: the three JSON shapes users already have, parsed into one validated Registry.

Every refusal is a CatalogError whose message names the offending tool, so a bad registry is
reported once, clearly, before anything is compiled or published.
"""
from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from dataclasses import dataclass

from shared.config import Settings


class CatalogError(ValueError):
    """The registry cannot become a catalog; the message says which tool and why."""


def clip(text: str, limit: int = 80) -> str:
    """text cut to limit characters (with a note of how much was cut): errors never echo unbounded input."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def shown(value, limit: int = 80) -> str:
    """repr(value), clipped: how an error message names a user's string."""
    return clip(repr(value), limit)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str = ""
    examples: tuple[str, ...] = ()
    input_schema: str = ""   # the tool's input schema as JSON text ("" when the registry gives none)

    def hashed_fields(self) -> list:
        """What a catalog's content hash covers of the tool: its schema only where it has one, so that a registry
        without schemas keeps the hash (and the version) it had before schemas were kept."""
        return [self.name, self.description, list(self.examples)] + ([self.input_schema] if self.input_schema else [])


@dataclass(frozen=True)
class Registry:
    """A parsed, validated registry: what compile_catalog turns into a catalog version."""

    tools: tuple[Tool, ...]

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tools]

    def content_hash_with(self, template, tokenizer_hash: str) -> str:
        """sha256 of everything a trie is compiled from: tools in order, prompt template, tokenizer.

        Publishing content with a hash seen before returns that version instead of a new one.
        """
        canon = json.dumps({"tools": [t.hashed_fields() for t in self.tools],
                            "prompt": template.to_json(), "tokenizer": tokenizer_hash},
                           ensure_ascii=False, separators=(",", ":"), sort_keys=True)
        return hashlib.sha256(canon.encode("utf-8")).hexdigest()


def _tool_entries(data) -> list[dict]:
    """Recognise the registry shape and return its tool objects as plain {name, description, examples}."""
    if isinstance(data, dict) and isinstance(data.get("tools"), list):  # MCP tools/list result
        data = data["tools"]
    if not isinstance(data, list):
        raise CatalogError("unknown registry shape: expected a list of tools, an MCP tools/list result "
                           "({\"tools\": [...]}) or OpenAI function tools ([{\"type\": \"function\", ...}])")
    entries = []
    for i, item in enumerate(data):
        if isinstance(item, dict) and item.get("type") == "function" and isinstance(item.get("function"), dict):
            item = item["function"]  # OpenAI-style function tool
        if not isinstance(item, dict) or "name" not in item:
            raise CatalogError(f"tool #{i}: expected an object with a 'name', got {clip(_brief(item))}")
        entries.append(item)
    return entries


def _brief(item) -> str:
    try:
        return json.dumps(item, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return type(item).__name__


def _check_text(value, what: str, where: str, limit: int) -> str:
    if not isinstance(value, str):
        raise CatalogError(f"{where}: {what} must be a string, got {type(value).__name__}")
    if len(value) > limit:
        raise CatalogError(f"{where}: {what} has {len(value)} characters, over the limit of {limit}")
    return value


def _check_schema(entry: dict, where: str, limit: int) -> str:
    """The tool's input schema (MCP's inputSchema, OpenAI's parameters) as compact JSON text, "" when it has
    none: a caller that found the tool can call it without its own copy of the registry, so it is kept whole,
    but it must be a JSON object and bounded."""
    key = "inputSchema" if "inputSchema" in entry else "parameters"
    schema = entry.get(key)
    if schema is None:
        return ""
    if not isinstance(schema, dict):
        raise CatalogError(f"{where}: {key} must be a JSON object, got {type(schema).__name__}")
    try:
        text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise CatalogError(f"{where}: {key} is not JSON: {clip(str(e))}") from None
    if len(text) > limit:
        raise CatalogError(f"{where}: {key} has {len(text)} characters of JSON, over the limit of {limit} "
                           "(TOOLTRIE_MAX_SCHEMA_CHARS)")
    return text


def _check_name(name, where: str, limit: int) -> str:
    name = _check_text(name, "name", where, limit)
    if not name.strip():
        raise CatalogError(f"{where}: name is empty or only whitespace")
    bad = [c for c in name if unicodedata.category(c) in ("Cc", "Cs", "Zl", "Zp")]
    if bad:
        raise CatalogError(f"{where}: name {shown(name)} contains the control character {bad[0]!r}")
    return name


def parse_registry(text: str | bytes, settings: Settings | None = None) -> Registry:
    """Parse registry JSON text into a validated Registry (limits from settings)."""
    settings = settings or Settings()
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CatalogError(f"malformed JSON: {e}") from None
    except RecursionError:
        raise CatalogError("malformed JSON: nested too deeply") from None
    try:
        return registry_from_entries(_tool_entries(data), settings)
    except RecursionError:   # an entry nested deeper than anything a tool needs
        raise CatalogError("the registry is nested too deeply") from None


def registry_from_entries(entries: list[dict], settings: Settings | None = None) -> Registry:
    """The validated Registry of already-decoded tool entries (limits from settings)."""
    settings = settings or Settings()
    if not entries:
        raise CatalogError("the registry holds no tools")
    if len(entries) > settings.max_tools:
        raise CatalogError(f"the registry holds {len(entries)} tools, over the limit of {settings.max_tools}")
    tools, seen, examples_seen = [], {}, 0
    for i, e in enumerate(entries):
        where = f"tool #{i}" + (f" ({shown(e['name'])})" if isinstance(e.get("name"), str) else "")
        name = _check_name(e.get("name"), where, settings.max_name_chars)
        description = _check_text(e.get("description") or "", "description", where,
                                  settings.max_description_chars)
        examples = e.get("examples") or []
        if not isinstance(examples, list):
            raise CatalogError(f"{where}: examples must be a list of strings")
        examples = tuple(_check_text(x, "example", where, settings.max_description_chars) for x in examples)
        examples_seen += len(examples)
        if examples_seen > settings.max_examples:
            raise CatalogError(f"{where}: the registry's examples pass the limit of {settings.max_examples} "
                               "(TOOLTRIE_MAX_EXAMPLES)")
        key = unicodedata.normalize("NFKC", name)
        if key in seen:
            other = entries[seen[key]]["name"]
            how = "" if other == name else " after Unicode normalisation"
            raise CatalogError(f"{where}: name {shown(name)} duplicates tool #{seen[key]} ({shown(other)}){how}")
        seen[key] = i
        tools.append(Tool(name, description, examples, _check_schema(e, where, settings.max_schema_chars)))
    return Registry(tuple(tools))


CATALOG_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_catalog_name(name: str) -> str:
    """Catalog names become Redis key parts and CLI arguments: keep them plain."""
    if not isinstance(name, str) or not CATALOG_NAME.fullmatch(name):
        raise CatalogError(f"catalog name {shown(name)} is not valid: use 1-64 of A-Z a-z 0-9 . _ - "
                           "starting with a letter or digit")
    return name

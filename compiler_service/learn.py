"""Learning from use: Feedback's checks, and Learn's registry (the latest version's, plus the feedback kept).

A version's blob holds everything its registry gave (names, descriptions, examples, input schemas), so the
latest version's registry is rebuilt from it exactly; Learn adds to each tool the intents it was chosen for on
its own that it does not already have as examples, and the compiler publishes the result as any registry: a
new version, verified by the decoders, hot-swapped, and undone by rolling back to the version before it.
"""
from __future__ import annotations

import json
import unicodedata

from shared.catalog import CatalogError, check_catalog_name, shown
from shared.feedback import MAX_INTENT_CHARS, MAX_TOOLS
from shared.tokenizer import ModelTokenizer
from shared.trie import Trie


def check_feedback(request, tok: ModelTokenizer, max_name_chars: int) -> None:
    """Feedback's bounds, before anything touches Redis: a catalog name, a version number, an intent that could
    become an example (bounded, no control characters, no special token), 1 to MAX_TOOLS distinct names."""
    check_catalog_name(request.name)
    if request.version < 1:
        raise CatalogError(f"version must be the version that answered (1 or more), got {request.version}")
    intent = request.intent
    if not intent.strip():
        raise CatalogError("the intent is empty")
    if len(intent) > MAX_INTENT_CHARS:
        raise CatalogError(f"the intent has {len(intent)} characters, over the limit of {MAX_INTENT_CHARS}")
    bad = next((c for c in intent if unicodedata.category(c) in ("Cc", "Cs") and c not in "\t\n\r"), None)
    if bad is not None:
        raise CatalogError(f"the intent contains the control character {bad!r}")
    special = next((t for t in map(tok.tokenizer.id_to_token, sorted(tok.special_ids)) if t in intent), None)
    if special is not None:
        raise CatalogError(f"the intent contains the special token {special!r}")
    if not 1 <= len(request.tools) <= MAX_TOOLS:
        raise CatalogError(f"feedback names 1 to {MAX_TOOLS} tools, got {len(request.tools)}")
    long = next((t for t in request.tools if len(t) > max_name_chars), None)
    if long is not None:
        raise CatalogError(f"tool name {shown(long)} has {len(long)} characters, over the limit of {max_name_chars}")
    if len(set(request.tools)) != len(request.tools):
        raise CatalogError("feedback names a tool twice")


def check_tools(tools, names: list[str], name: str, version: int) -> None:
    """Every chosen tool is one of the version's."""
    known = set(names)
    missing = next((t for t in tools if t not in known), None)
    if missing is not None:
        raise CatalogError(f"catalog {name!r} v{version} has no tool named {shown(missing)}")


def learned_registry(trie: Trie, chosen: dict[str, list[str]], max_examples: int) -> tuple[list[dict], int]:
    """The version's registry with each tool's new chosen intents appended to its examples (oldest first, while
    the catalog's examples stay within max_examples); returns it and how many examples were added."""
    meta = trie.meta
    total = sum(len(e) for e in meta["examples"])
    registry, added = [], 0
    for i, name in enumerate(trie.pointer_names):
        examples = list(meta["examples"][i])
        have = set(examples)
        for intent in chosen.get(name, ()):
            if intent not in have and total + added < max_examples:
                examples.append(intent)
                have.add(intent)
                added += 1
        tool = {"name": name, "description": meta["descriptions"][i] or "", "examples": examples}
        schema = (meta.get("input_schemas") or [""] * len(trie.pointer_names))[i]
        if schema:
            tool["inputSchema"] = json.loads(schema)
        registry.append(tool)
    return registry, added

"""The labelled tool-discovery data sets beside the repository, and the fixed validation split.

A query is in the validation split iff a stable hash of its normalised text says so (about 25%):
`tune` never trains on it and `make quality` reports on it. Of the rest (the training split) another hash
keeps about 15% as the selection split: the shipped adapters never train on it, and settings that depend on
the adapters (the fusion weight) are chosen there. The rules are written down in docs/quality.md.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from shared.config import REPO_ROOT

SETS = {"metatool": "MetaTool", "toolbench": "StableToolBench", "bigcatalog": "Seal-Tools"}
VALIDATION_PERCENT = 25
SELECTION_PERCENT = 15   # of the training split
SPLITS = ("train", "selection", "validation", "all")


def normalise(query: str) -> str:
    return " ".join(query.split()).casefold()


def bucket(salt: str, text: str, buckets: int = 100) -> int:
    """A stable bucket of a text: sha256 of salt + text, its first 8 hex digits mod `buckets`."""
    return int(hashlib.sha256((salt + text).encode("utf-8")).hexdigest()[:8], 16) % buckets


def is_validation(query: str) -> bool:
    """The fixed split: sha256 of "valid:" + the normalised query, its first 8 hex digits mod 100 < 25."""
    return bucket("valid:", normalise(query)) < VALIDATION_PERCENT


def is_selection(query: str) -> bool:
    """Within the training split: sha256 of "select:" + the normalised query, its first 8 hex digits mod 100
    < 15. Part of the training split (its queries are published as examples), never trained on by `tune`."""
    return not is_validation(query) and bucket("select:", normalise(query)) < SELECTION_PERCENT


def in_split(query: str, split: str) -> bool:
    """Whether a query is in the split: "train" (not validation; selection included), "selection",
    "validation" or "all"."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    return {"all": True, "train": not is_validation(query), "selection": is_selection(query),
            "validation": is_validation(query)}[split]


@dataclass(frozen=True)
class Query:
    text: str
    tools: tuple[str, ...]   # the gold tool names; k = len(tools)


def data_dir() -> Path:
    """../shared/data beside the checkout, TOOLTRIE_SHARED_DATA, or the copy carried to a GPU machine."""
    for d in (os.environ.get("TOOLTRIE_SHARED_DATA"), REPO_ROOT.parent / "shared" / "data", REPO_ROOT / ".gpu_data"):
        if d and (Path(d) / "metatool" / "catalog.json").exists():
            return Path(d)
    raise SystemExit("no tool data: expected ../shared/data beside the checkout (or TOOLTRIE_SHARED_DATA)")


def catalog_path(name: str) -> Path:
    return data_dir() / name / "catalog.json"


def held_out(names: list[str], fraction: float) -> frozenset[str]:
    """A stable `fraction` of a catalog's tool names, chosen by a hash of the name: tools treated as new to
    the catalog (no labelled query trains or describes them), so that quality on them can be reported."""
    cut = int(fraction * 10_000)
    return frozenset(n for n in names if bucket("holdout:", n, 10_000) < cut)


def registry(name: str, leave_out: frozenset[str] = frozenset(), new: frozenset[str] = frozenset()) -> str:
    """A set's catalog as registry JSON, published as `published` says with its training split's queries."""
    tools = json.loads(catalog_path(name).read_text(encoding="utf-8"))
    return published(tools, queries(name, "train"), leave_out, new)


def published(tools: list[dict], labelled: list[Query], leave_out: frozenset[str] = frozenset(),
              new: frozenset[str] = frozenset()) -> str:
    """Registry JSON whose tools carry, besides their own examples, the labelled queries that ask for that
    tool alone (less those in leave_out, the queries a run measures, and none for the tools in `new`): the
    labelled requests an operator publishes with a catalog, never a validation one."""
    examples: dict[str, list[str]] = {}
    for q in labelled:
        if len(q.tools) == 1 and q.text not in leave_out and q.tools[0] not in new:
            examples.setdefault(q.tools[0], []).append(q.text)
    return json.dumps([{"name": t["name"], "description": t.get("description", ""),
                        "examples": list(t.get("examples") or []) + examples.get(t["name"], [])}
                       for t in tools], ensure_ascii=False)


def queries(name: str, split: str = "all") -> list[Query]:
    """A set's labelled queries in a split (see in_split)."""
    return [q for q in read_queries(data_dir() / name / "dev_queries.jsonl") if in_split(q.text, split)]


def read_queries(path: Path) -> list[Query]:
    """Labelled queries in the dev_queries.jsonl format: one {"query", "tools"} object a line."""
    with open(path, encoding="utf-8") as f:
        return [Query(q["query"], tuple(q["tools"])) for q in map(json.loads, filter(str.strip, f))]

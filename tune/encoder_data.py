"""The encoder's training data: request -> tool-text pairs of the training splits, and each epoch's batches."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

from shared import dataset


@dataclass(frozen=True)
class Catalog:
    """One data set's tools as the encoder reads them (tool_text), by index in its catalog.json."""
    name: str
    names: list[str]
    texts: list[str]
    descriptions: list[str]

    @property
    def index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.names)}


@dataclass(frozen=True)
class Pair:
    """A labelled request and one of its gold tools (indices into its catalog); `gold` is every gold tool of the
    request, none of which may serve it as a negative."""
    catalog: str
    query: str
    tool: int
    gold: frozenset[int]


def tool_text(name: str, description: str) -> str:
    """What the encoder reads of a tool, as decoder_service.retrieval.vectors.tool_texts writes it (tune runs where
    the services' dependencies may be missing; tests/test_tune_encoder.py checks that the two agree)."""
    return f"{name}: {description}" if description else name


def catalog(name: str) -> Catalog:
    """A data set's catalog (shared.dataset.catalog_path)."""
    tools = json.loads(dataset.catalog_path(name).read_text(encoding="utf-8"))
    descriptions = [t.get("description", "") for t in tools]
    return Catalog(name, [t["name"] for t in tools], [tool_text(t["name"], d) for t, d in zip(tools, descriptions)],
                   descriptions)


def split_queries(name: str, split: str) -> list[dataset.Query]:
    """A set's queries: "fit" is the training split less the selection split (what the encoder trains on);
    "selection" and "validation" as shared.dataset defines them."""
    if split == "fit":
        return [q for q in dataset.queries(name, "train") if not dataset.is_selection(q.text)]
    return dataset.queries(name, split)


def pairs(cat: Catalog, queries: list[dataset.Query]) -> list[Pair]:
    """One pair per (query, gold tool)."""
    index = cat.index
    out = []
    for q in queries:
        gold = frozenset(index[t] for t in q.tools)
        out += [Pair(cat.name, q.text, index[t], gold) for t in q.tools]
    return out


def epoch(items: list[Pair], size: int, rng: random.Random, per_tool: int = 0) -> list[list[Pair]]:
    """One epoch's batches: the pairs shuffled, at most `per_tool` of each tool's (a fresh draw each epoch, so that a
    tool asked for hundreds of times does not fill the epoch; 0: all), cut into batches of `size`. A tool may come
    twice in a batch: the loss masks every gold tool of a row but its own (tune/encoder.py)."""
    order = list(items)
    rng.shuffle(order)
    if per_tool:
        taken: dict[tuple[str, int], int] = {}
        kept = []
        for p in order:
            key = (p.catalog, p.tool)
            if taken.get(key, 0) < per_tool:
                taken[key] = taken.get(key, 0) + 1
                kept.append(p)
        order = kept
    return [order[at:at + size] for at in range(0, len(order), size)]

"""Training and validation examples: labelled queries, synthetic ones, shortlists, and their token ids."""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from compiler_service.compiler import tokenize_names
from decoder_service.retrieval.vectors import written_request
from shared.catalog import parse_registry
from shared.dataset import Query, held_out, is_selection, is_validation
from shared.prompt import default_template
from shared.tokenizer import ModelTokenizer
from tune.shortlist import Shortlister, with_gold

SYNTHETIC_TEMPLATES = ("{d}", "I need to {d}", "Can you {d}?", "Help me {d}", "Is there a way to {d}?")


@dataclass
class Catalog:
    """One catalog as the prompt shows it (names, prompt descriptions, each name's answer tokens), and as it is
    published for retrieval (its registry's tools with the training split's labelled queries as examples)."""
    name: str
    tools: list[dict]                                 # the registry's tools
    names: list[str]
    descriptions: list[str]
    name_ids: list[list[int]]
    line_ids: list[list[int]]                         # each tool's prompt line, tokenized once (as a served version's)
    digest: str                                       # sha256 of the registry file
    labelled: list[Query] = field(default_factory=list)   # the training split, published as examples
    held_out: frozenset[int] = frozenset()            # tools kept out of every labelled training query
    index: dict[str, int] = field(default_factory=dict)

    @property
    def new(self) -> frozenset[str]:
        """The held-out tools' names: published without examples, like tools new to a catalog."""
        return frozenset(self.names[i] for i in self.held_out)


@dataclass
class Item:
    """One query over one catalog: its gold tools (indices, in answer order) and its retrieved shortlist."""
    catalog: Catalog
    query: str
    gold: list[int]
    shortlist: list[int]                              # tool indices, retrieval order
    synthetic: bool = False


@dataclass(frozen=True)
class Source:
    """A labelled data set: a registry file and a queries file in the dev_queries.jsonl format."""
    name: str
    registry: Path
    queries: Path


class Encoder:
    """Prompt and answer token ids, built with the serving prompt's own functions."""

    def __init__(self, model_dir: Path):
        self.tok = ModelTokenizer(model_dir)
        self.template = default_template(*self.tok.chat_format())
        self.sep_id = self.tok.single_token(self.template.separator, "separator")
        self.stop_id = self.tok.single_token(self.template.stop_token, "stop token")
        self.prefix_ids = self.tok.encode(self.template.prefix)

    def catalog(self, source: Source) -> Catalog:
        """The source's catalog with each name tokenized as the compiler writes it."""
        raw = source.registry.read_bytes()
        tools = parse_registry(raw).tools
        names = [t.name for t in tools]
        ids = tokenize_names(names, self.tok, self.template.separator, self.sep_id)
        lines = self.tok.encode_batch([self.template.line(t.name, t.description) for t in tools])
        return Catalog(source.name, json.loads(raw), names, [t.description for t in tools], ids, lines,
                       hashlib.sha256(raw).hexdigest(), index={n: i for i, n in enumerate(names)})

    def prompt(self, item: Item, order: list[int]) -> list[int]:
        """The request's prompt with the shortlist listed in `order` (tool indices)."""
        lines = [item.catalog.line_ids[i] for i in order]
        return self.prefix_ids + self.template.request_ids(self.tok, lines, item.query, len(item.gold))

    def answer(self, item: Item) -> list[int]:
        """The gold names' tokens, separator between two, the stop token last."""
        out: list[int] = []
        for j, g in enumerate(item.gold):
            out += item.catalog.name_ids[g] + [self.sep_id if j + 1 < len(item.gold) else self.stop_id]
        return out

    def order(self, item: Item, rng: random.Random, shuffle: bool = True) -> list[int]:
        """The shortlist in a fresh random order or (shuffle False) as retrieved."""
        order = list(item.shortlist)
        if shuffle:
            rng.shuffle(order)
        return order

    def example(self, item: Item, rng: random.Random, shuffle: bool = True) -> tuple[list[int], list[int]]:
        """(prompt ids, answer ids), the shortlist in `order`'s order."""
        return self.prompt(item, self.order(item, rng, shuffle)), self.answer(item)


def held_out_tools(names: list[str], fraction: float) -> frozenset[int]:
    """The indices of shared.dataset.held_out's tools: a stable fraction of the catalog, by a hash of the name."""
    new = held_out(names, fraction)
    return frozenset(i for i, n in enumerate(names) if n in new)


def synthetic_query(description: str, rng: random.Random) -> str:
    """A request written from a tool's description with one of a few templates."""
    return written_request(description, rng.choice(SYNTHETIC_TEMPLATES))


def items(catalog: Catalog, queries: list[Query], n: int, shortlister: Shortlister, leave_own_fold: bool = False,
          synthetic: bool = False) -> list[Item]:
    """Items for queries over a catalog with their retrieved shortlists (gold not inserted); leave_own_fold for
    labelled training queries, whose own examples must not shortlist them."""
    lists = shortlister.shortlists(catalog.tools, catalog.labelled, catalog.new, [q.text for q in queries], n,
                                   leave_own_fold)
    return [Item(catalog, q.text, [catalog.index[t] for t in q.tools], [catalog.index[t] for t in s], synthetic)
            for q, s in zip(queries, lists)]


def split(catalog: Catalog, queries: list[Query]) -> tuple[list[Query], list[Query], list[Query]]:
    """(training, selection, validation) queries by the fixed splits: training is the training split less the
    selection split and less queries with a held-out gold tool. Sets the catalog's published examples: the
    training split (the selection split included: it is published, only not trained on)."""
    catalog.labelled = [q for q in queries if not is_validation(q.text)]
    train = [q for q in catalog.labelled if not is_selection(q.text)
             and not any(catalog.index[t] in catalog.held_out for t in q.tools)]
    return train, [q for q in catalog.labelled if is_selection(q.text)], [q for q in queries if is_validation(q.text)]


def synthetic(catalog: Catalog, train: list[Query], rng: random.Random) -> list[Query]:
    """One synthetic query per tool that no training query names (held-out tools included), if described."""
    named = {t for q in train for t in q.tools}
    return [Query(synthetic_query(d, rng), (n,)) for n, d in zip(catalog.names, catalog.descriptions)
            if n not in named and d.strip()]


def training_items(catalog: Catalog, queries: list[Query], n: int, repeat: int, shortlister: Shortlister,
                   rng: random.Random, synthetic: bool = False) -> list[Item]:
    """Training items, gold inserted into each shortlist (at a position drawn from rng), the set's items repeated
    `repeat` times; a labelled query is shortlisted without its own fold's examples."""
    out = items(catalog, queries, n, shortlister, leave_own_fold=not synthetic, synthetic=synthetic)
    for it in out:
        it.shortlist = with_gold(it.shortlist, it.gold, rng)
    return out * repeat

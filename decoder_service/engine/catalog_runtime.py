"""One catalog version as the engine serves it: the trie, its retriever, its prompt, and its shared prefix KV.

The prefix (the start of the system turn) is the same for every request on a version, so its KV is
computed once. Its whole blocks are shared, reference-counted, by every request on it;
its last partial block (the tail) is kept in a block of the version's own, and each request starts
with a copy of those positions in its first block (a few positions of K/V copied on the device
instead of up to block_size - 1 prompt rows computed per request).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from decoder_service.engine.sampler import compile_for
from decoder_service.retrieval.host import Retriever
from shared.prompt import PromptTemplate, line_units
from shared.tokenizer import ModelTokenizer
from shared.trie import SEP, STOP, Trie, control_edge_legal


@dataclass
class CatalogRuntime:
    trie: Trie
    retriever: Retriever
    template: PromptTemplate
    tokenizer: ModelTokenizer   # the version's prompt lines are its tokens
    prefix_ids: list[int]
    block_size: int
    # KV of prefix_ids[:shared_tokens]; an int32 array, set once by the warm-up, so that every step's
    # block tables copy it as it is
    shared_blocks: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    tail_block: int = -1  # KV of prefix_ids[shared_tokens:] at its first positions (-1: no tail)
    ready: threading.Event = field(default_factory=threading.Event)
    warm_seconds: float = 0.0
    lines_seconds: float = 0.0   # line_kv: from the prefix warm to its tool lines computed (engine._warm_lines)
    lines_ready: threading.Event = field(default_factory=threading.Event)
    fusion_weight: float = 0.0   # logits a retrieval rank is worth in this version's answers (engine.fusion)

    @classmethod
    def from_trie(cls, trie: Trie, retriever: Retriever, tokenizer, block_size: int) -> "CatalogRuntime":
        template = PromptTemplate.from_json(trie.meta["prompt"])
        rt = cls(trie=trie, retriever=retriever, template=template, tokenizer=tokenizer,
                 prefix_ids=tokenizer.encode(template.prefix), block_size=block_size)
        rt.build_tables()
        return rt

    def build_tables(self) -> None:
        """Build every table below that is taken once (each cached_property) now, and compile the sampler's helpers
        for them: at load, off every request's path, so that a version's first request costs what any other does
        (issue 30's swap)."""
        for name, attr in vars(type(self)).items():
            if isinstance(attr, cached_property):
                getattr(self, name)
        compile_for(self)

    @property
    def key(self) -> tuple[str, int]:
        return self.trie.meta.get("name", ""), self.trie.meta.get("version", 0)

    @property
    def shared_tokens(self) -> int:
        """Prefix tokens whose KV lives in shared blocks (whole blocks only)."""
        return len(self.prefix_ids) // self.block_size * self.block_size

    @property
    def tail_tokens(self) -> int:
        """Prefix tokens past the last whole block, copied into each request's first block."""
        return len(self.prefix_ids) - self.shared_tokens

    def held_blocks(self) -> np.ndarray:
        """The blocks the version itself holds a reference to: the shared ones and the tail's."""
        if self.tail_block < 0:
            return self.shared_blocks
        return np.append(self.shared_blocks, np.int32(self.tail_block)).astype(np.int32)

    @property
    def max_output_tokens_per_pointer(self) -> int:
        """A pointer's deepest token path plus its control token (separator or stop)."""
        return int(self.trie.meta["max_pointer_tokens"]) + 1

    @cached_property
    def examples_share(self) -> float:
        """The share of the version's tools published with example requests (decoder_service.reader.reads)."""
        examples = self.trie.meta.get("examples") or []
        return sum(1 for e in examples if e) / max(1, len(self.trie.pointer_names))

    @cached_property
    def max_fanout(self) -> int:
        """The trie's widest node (the device sampler's candidate bound), taken once: the sampler asks
        every step, and the scan over a 4,000-tool trie's nodes costs tens of µs."""
        return self.trie.max_fanout()

    @cached_property
    def edge_node(self) -> np.ndarray:
        """int [edges]: the node each edge leaves (the per-node tables below are built from it)."""
        return np.repeat(np.arange(self.trie.num_nodes), np.diff(self.trie.node_edge_start))

    @cached_property
    def stop_nodes(self) -> np.ndarray:
        """bool [nodes]: the nodes with a stop edge, where a row on its last pointer may pick the stop."""
        ends = np.zeros(self.trie.num_nodes, bool)
        ends[self.edge_node[self.trie.edge_child == STOP]] = True
        return ends

    @cached_property
    def node_span(self) -> tuple[np.ndarray, np.ndarray]:
        """(lo, hi), int32 [nodes]: the pointers below each node, one range (pointers are numbered depth first);
        the sampler's forced_edge counts a request's live pointers in it."""
        t = self.trie
        starts = t.node_edge_start[:-1]
        return (np.minimum.reduceat(t.edge_lo, starts).astype(np.int32),
                np.maximum.reduceat(t.edge_hi, starts).astype(np.int32))

    @cached_property
    def last_pointer_edge(self) -> np.ndarray:
        """int32 [nodes]: at a node whose subtree holds one pointer, the one edge a row on its last
        pointer can take (its name's next token, or stop at its end: the separator is not legal there),
        else -1. The sampler's only candidate wins with log-probability 0 whatever the logits, so the
        engine takes these edges without computing them."""
        t = self.trie
        starts = t.node_edge_start[:-1]
        one = np.maximum.reduceat(t.edge_hi, starts) - np.minimum.reduceat(t.edge_lo, starts) == 1
        barred = [c for c in (SEP, STOP) if not control_edge_legal(c, 0, 1)]   # illegal on the last pointer
        edges = np.flatnonzero(~np.isin(t.edge_child, barred)).astype(np.int32)
        owner = self.edge_node[edges]
        forced = np.full(t.num_nodes, -1, np.int32)
        forced[owner[one[owner]]] = edges[one[owner]]
        return forced

    @cached_property
    def name_index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.trie.pointer_names)}

    @cached_property
    def spelled(self) -> list[list[int]]:
        """Each pointer's tokens, by pointer id (taken once: retrieval-only answers stream them)."""
        return self.trie.spelled()

    @property
    def descriptions(self) -> list[str]:
        return self.trie.meta["descriptions"]

    @cached_property
    def lines(self) -> tuple[np.ndarray, np.ndarray]:
        """Every tool's prompt line as tokens: (int32 tokens end to end, int64 [tools + 1] offsets by pointer id);
        tokenized once, at load, in one batch (P86)."""
        ids = self.tokenizer.encode_batch([self.template.line(n, d)
                                           for n, d in zip(self.trie.pointer_names, self.descriptions)])
        offsets = np.zeros(len(ids) + 1, np.int64)
        np.cumsum([len(x) for x in ids], out=offsets[1:])
        return np.fromiter((t for x in ids for t in x), np.int32, int(offsets[-1])), offsets

    def request_ids(self, tools, intent: str, k: int, intent_ids: list[int] | None = None) -> list[int]:
        """A request's own prompt tokens after the prefix (PromptTemplate.request_ids): its shortlist's lines
        (`tools`: pointer ids) in that order, then the intent (intent_ids: its tokens, already taken) and k."""
        flat, at = self.lines
        return self.template.request_ids(self.tokenizer, [flat[at[i]:at[i + 1]].tolist() for i in tools], intent, k,
                                         intent_ids)

    @cached_property
    def prefix_key(self) -> tuple[int, ...]:
        return tuple(self.prefix_ids)

    def line_keys(self, tools, k: int) -> tuple[list[tuple], int]:
        """The kept-line keys of a request's shortlist (`tools`: pointer ids, in prompt order; engine/lines.py): each
        the prefix and the tool's line with its newline; and the prompt rows they fill (the last line's newline is
        not the prompt's). ([], 0) where the template does not list the tools right after the prefix."""
        flat, at = self.lines
        cut = line_units(self.template, self.tokenizer, [flat[at[i]:at[i + 1]].tolist() for i in tools], k)
        if cut is None:
            return [], 0
        units, rows = cut
        return [(self.prefix_key, tuple(unit)) for unit in units], rows

    def pointer_ids(self, names: list[str]) -> np.ndarray:
        """Sorted pointer ids of an allowlist; a KeyError names the first unknown tool."""
        missing = [n for n in names if n not in self.name_index]
        if missing:
            raise KeyError(missing[0])
        return np.unique(np.asarray([self.name_index[n] for n in names], dtype=np.int32))

    def describe(self) -> dict:
        name, version = self.key
        return {"name": name, "version": version, "tools": len(self.trie.pointer_names),
                "prefix_tokens": len(self.prefix_ids), "ready": self.ready.is_set(),
                "warm_seconds": round(self.warm_seconds, 3), "lines_seconds": round(self.lines_seconds, 3)}

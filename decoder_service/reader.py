"""The reader: the writer model scoring a shortlist by how likely each tool makes the request (query likelihood).

On a catalog the selector was not tuned on, the generator choosing among tool names adds nothing (docs/quality.md);
read the other way round it does. A model fine-tuned to write the requests a tool answers from its name and
description (`python -m tune.writer`) gives log P(request | tool), the sum of the request's token log-probabilities
after its prompt for that tool, for the whole request and each of its clauses. A tool's reader score weighs the
request's and its best clause's, each part's log-likelihoods standardised over the shortlist; the answer is the top
k of z(retrieval) + reader score (the weights chosen on the selection split).
"""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

from decoder_service.model.batch import StepBatch
from decoder_service.retrieval.host import Shortlist, intent_parts, standardised, top_n
from shared.prompt import chat_format, tool_line
from shared.tokenizer import ModelTokenizer

INSTRUCTION = "Write a request a user could send that this tool answers.\nTool: "
DESCRIPTION_CHARS = 300
WEIGHTS = (1.0, 2.0)   # the request's and its best clause's weights against retrieval's (the selection split's best)
PART_TOKENS = 128      # a part's tokens read (longer ones are cut) ...
READ_TOKENS = 512      # ... and the parts' tokens read a tool (the clauses past it are not read): a request's work
BLOCK = 16
HEADS_KEPT = {"cuda": 4096, "cpu": 512}   # KV blocks kept for heads; SmolLM2: 1.4 GiB bf16, 360 MiB float32
EXAMPLES_SHARE = 0.5   # a version with examples on this share of its tools or more is answered in retrieval's order


class Prompts:
    """The writer's prompt and target token ids, in the model's chat format."""

    def __init__(self, model_dir: Path):
        self.tok = ModelTokenizer(model_dir)
        start, end, stop = chat_format(model_dir)
        self.head, self.tail = start.format(role="user") + INSTRUCTION, end + start.format(role="assistant")
        self.stop_id = self.tok.single_token(stop, "stop token")

    def prompt(self, name: str, description: str, opener: str = "") -> list[int]:
        """The tokens the writer writes a request for this tool after (then the opener's, if any)."""
        line = tool_line(name, description, DESCRIPTION_CHARS)[2:]
        return self.tok.encode(self.head + line + self.tail + opener)


def reads(rt) -> bool:
    """Whether the reader answers a version (rt: its CatalogRuntime): only where under EXAMPLES_SHARE of its tools have
    example requests. With examples on most tools, BM25 over them and their vote do better: MetaTool published with
    its training requests, fused retrieval 0.800, the reader 0.730 (docs/quality.md)."""
    return rt.examples_share < EXAMPLES_SHARE


def trained_sets(model_dir: Path) -> set[str]:
    """The data sets a reader's writer was trained on (its merged adapters' config; none for an untrained base)."""
    config = Path(model_dir) / "tune_adapter_config.json"
    return set(json.loads(config.read_text())["base"].get("trained_on", [])) if config.is_file() else set()


def z(x) -> np.ndarray:
    """x standardised over all its entries."""
    x = np.asarray(x, np.float64)
    return standardised(x, np.ones(len(x), bool))


def reader_score(parts, weights: tuple[float, float] = WEIGHTS) -> np.ndarray:
    """A tool's reader score: the request's log-likelihood and its best clause's (the request's where it has no
    clauses), weighted, each part's standardised over the shortlist (a request for several tools names each in a
    clause, and parts differ in length)."""
    zs = [z(p) for p in parts]
    return weights[0] * zs[0] + weights[1] * np.max(zs[1:] or zs, axis=0)


def reranked(retrieval: np.ndarray, parts, k: int, weights: tuple[float, float] = WEIGHTS) -> np.ndarray:
    """Shortlist positions of the top k by z(retrieval) + reader score; the earlier position on a tie."""
    return top_n(z(retrieval) + reader_score(parts, weights), k)


class Heads:
    """The K/V blocks of the heads the reader keeps, by their tokens, least recently read first (A2)."""

    def __init__(self, blocks):
        self.free = list(blocks)
        self.capacity = len(self.free)
        self.blocks: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()

    def touch(self, prefix: tuple[int, ...]) -> bool:
        """Whether the prefix is kept (now the most recently read)."""
        if prefix in self.blocks:
            self.blocks.move_to_end(prefix)
            return True
        return False

    def take(self, prefix: tuple[int, ...], count: int, needed: set) -> list[int]:
        """`count` blocks for the prefix, the least recently read heads not `needed` dropped for them."""
        while len(self.free) < count:
            old = next(p for p in self.blocks if p not in needed)
            self.free += self.blocks.pop(old)
        self.blocks[prefix], self.free = self.free[:count], self.free[count:]
        return self.blocks[prefix]


class Reader:
    """The writer model on a backend of its own, scoring one request's shortlist at a time."""

    def __init__(self, model_dir: Path, backend: str = "auto", step_rows: int | None = None,
                 heads_kept: int | None = None):
        from decoder_service.gpu.device import resolve_backend
        from decoder_service.model.backend import make_backend, weights_dtype
        from decoder_service.model.config import ModelConfig
        from decoder_service.model.kv_pool import KVPoolSpec
        from decoder_service.model.weights import load_weights
        self.model_dir = Path(model_dir)
        self.prompts = Prompts(self.model_dir)
        cfg = ModelConfig.from_dir(self.model_dir)
        self.kind = resolve_backend(backend)
        self.step_rows = step_rows or (4096 if self.kind == "cuda" else 1024)
        self.logit_rows = self.step_rows // 4 if self.kind == "cuda" else self.step_rows // 2
        self.max_sequence = min(cfg.max_position_embeddings, 1024)
        self.max_blocks = -(-self.max_sequence // BLOCK)
        # a step's parts (their rows plus a partial block each), then the heads kept
        self.step_blocks = self.step_rows // BLOCK + self.logit_rows
        kept = heads_kept if heads_kept is not None else HEADS_KEPT[self.kind]
        longest = -(-(self.max_sequence - PART_TOKENS) // BLOCK)   # a head's blocks at most (`tokens`)
        self.heads = Heads(range(self.step_blocks, self.step_blocks + max(kept, longest)))
        spec = KVPoolSpec(num_blocks=self.step_blocks + self.heads.capacity, block_size=BLOCK)
        weights = load_weights(self.model_dir, cfg, weights_dtype(self.kind, cfg))
        options = {} if self.kind == "cpu" else {"max_rows": self.step_rows, "max_logit_rows": self.logit_rows,
                                                 "max_table": 2 * self.logit_rows * self.max_blocks}
        self.model = make_backend(cfg, weights, spec, backend=self.kind, **options)
        self.lock = threading.Lock()

    def likelihoods(self, heads: list[list[int]], parts: list[list[int]]) -> np.ndarray:
        """float64 [parts, heads]: each part's summed token log-probabilities after each head. A head's K/V but its
        last token's are computed once and kept (least recently read dropped first); each part is read after it
        from the head's last token on, so that no head is computed twice and a row never depends on the others in
        its step. Tools go in groups whose parts fit a step."""
        out = np.zeros((len(parts), len(heads)))
        rows = sum(len(p) for p in parts)
        with self.lock:
            group: list[int] = []
            for h in range(len(heads)):
                if group and not self._fits(group + [h], heads, parts, rows):
                    self._read(group, heads, parts, out)
                    group = []
                group.append(h)
            self._read(group, heads, parts, out)
        return out

    def _fits(self, group: list[int], heads, parts, rows: int) -> bool:
        blocks = sum(-(-((len(heads[h]) - 1) % BLOCK + len(p)) // BLOCK) for h in group for p in parts)
        kept = sum(-(-(len(heads[h]) - 1) // BLOCK) for h in group)
        return (len(group) * rows <= self.logit_rows and blocks <= self.step_blocks
                and len(group) * len(parts) <= 2 * self.logit_rows and kept <= self.heads.capacity)

    def _read(self, group: list[int], heads, parts, out) -> None:
        prefixes = [tuple(heads[h][:-1]) for h in group]
        self._keep(prefixes)
        tables = np.full((len(group) * len(parts), self.max_blocks), -1, np.int32)
        tokens, slots, positions, targets, owners, free, moves = [], [], [], [], [], 0, []
        for g, (h, prefix) in enumerate(zip(group, prefixes)):
            kept, n = self.heads.blocks[prefix], len(prefix)
            full = n // BLOCK
            for p, part in enumerate(parts):
                row = g * len(parts) + p
                own = -(-(n % BLOCK + len(part)) // BLOCK)
                tables[row, :full] = kept[:full]
                tables[row, full:full + own] = np.arange(free, free + own)
                moves += [(kept[full] * BLOCK + i, free * BLOCK + i) for i in range(n % BLOCK)]
                free += own
                tokens += [heads[h][-1]] + part[:-1]
                slots += [row] * len(part)
                positions += range(n, n + len(part))
                targets += part
                owners += [(p, h)] * len(part)
        if moves:   # each head's partial block into each of its parts' first blocks, in one move
            src, dst = np.asarray(moves, np.int32).T
            self.model.place_kv(src, dst, np.zeros_like(src))
        batch = StepBatch(*(np.asarray(a, np.int32) for a in (tokens, slots, positions, tables, range(len(tokens)))))
        for (p, h), value in zip(owners, self._run(batch, targets)):
            out[p, h] += value

    def _keep(self, prefixes: list[tuple[int, ...]]) -> None:
        """Compute the K/V of the prefixes not kept yet into blocks of their own, in steps of at most step_rows."""
        missing, needed = list(dict.fromkeys(p for p in prefixes if not self.heads.touch(p))), set(prefixes)
        while missing:
            chunks, rows = [], 0
            while missing and (not chunks or rows + len(missing[0]) <= self.step_rows):
                prefix = missing.pop(0)
                chunks.append((len(chunks), prefix, 0))
                rows += len(prefix)
            tables = np.full((len(chunks), self.max_blocks), -1, np.int32)
            for slot, prefix, _ in chunks:
                blocks = self.heads.take(prefix, -(-len(prefix) // BLOCK), needed)
                tables[slot, :len(blocks)] = blocks
            self.model.forward(StepBatch.from_chunks(chunks, tables))

    def _run(self, batch: StepBatch, targets) -> np.ndarray:
        """One forward step and its logit rows' log-probabilities of the targets (float64)."""
        self.model.forward(batch)
        return self.model.token_logprobs(np.asarray(targets, np.int32)).astype(np.float64)

    def read(self, trie, intent: str, shortlist: Shortlist, k: int) -> Shortlist:
        """The shortlist's top k by retrieval and the reader together (`reranked`), best first; its `seconds`
        are the reader's."""
        started = time.perf_counter()
        names, descriptions = trie.pointer_names, trie.meta["descriptions"]
        order = reranked(shortlist.scores, self.likelihoods(*self.tokens([(names[i], descriptions[i])
                                                                          for i in shortlist.ids], intent)), k)
        return Shortlist(shortlist.ids[order], shortlist.scores[order], time.perf_counter() - started)

    def tokens(self, tools: list[tuple[str, str]], intent: str) -> tuple[list[list[int]], list[list[int]]]:
        """(heads, parts): each (name, description)'s prompt, and the intent's parts (intent_parts), cut to
        PART_TOKENS each and READ_TOKENS in all."""
        room = self.max_sequence - PART_TOKENS   # a head past it keeps its end, where the tool line is
        heads = [self.prompts.prompt(name, description)[-room:] for name, description in tools]
        parts, read = [], 0
        for part in intent_parts(intent):
            ids = self.prompts.tok.encode(part)[:PART_TOKENS]
            if read + len(ids) > READ_TOKENS:
                break
            parts.append(ids)
            read += len(ids)
        return heads, parts

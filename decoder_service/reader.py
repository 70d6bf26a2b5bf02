"""The reader: the writer model scoring a shortlist by how likely each tool makes the request (query likelihood).

On a catalog the selector was not tuned on, the generator choosing among tool names adds nothing (docs/quality.md);
read the other way round it does. A model fine-tuned to write the requests a tool answers from its name and
description (`python -m tune.writer`) gives log P(request | tool), the sum of the request's token log-probabilities
after its prompt for that tool, for the whole request and each of its clauses. A tool's reader score is its best
clause's, each clause's log-likelihoods standardised over the shortlist; the answer is the top k of
z(retrieval) + beta * reader score (beta chosen on the selection split).
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from decoder_service.model.batch import StepBatch
from decoder_service.retrieval.host import Shortlist, intent_parts, standardised, top_n
from shared.prompt import chat_format, tool_line
from shared.tokenizer import ModelTokenizer

INSTRUCTION = "Write a request a user could send that this tool answers.\nTool: "
DESCRIPTION_CHARS = 300
BETA = 1.0             # the reader's weight against retrieval's: the selection split's best over the three sets
PART_TOKENS = 128      # a part's tokens read (longer ones are cut) ...
READ_TOKENS = 512      # ... and the parts' tokens read a tool (the clauses past it are not read): a request's work
BLOCK = 16
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


def reader_score(parts) -> np.ndarray:
    """A tool's reader score: its best clause's log-likelihood, each clause standardised over the shortlist (a
    request for several tools names each in a clause, and clauses differ in length)."""
    return np.max([z(p) for p in parts], axis=0)


def reranked(retrieval: np.ndarray, parts, k: int, beta: float = BETA) -> np.ndarray:
    """Shortlist positions of the top k by z(retrieval) + beta * reader score; the earlier position on a tie."""
    return top_n(z(retrieval) + beta * reader_score(parts), k)


class Reader:
    """The writer model on a backend of its own, scoring one request's shortlist at a time."""

    def __init__(self, model_dir: Path, backend: str = "auto", step_rows: int | None = None):
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
        # every sequence of a step at once: its rows plus a partial block each
        spec = KVPoolSpec(num_blocks=self.step_rows // BLOCK + self.logit_rows, block_size=BLOCK)
        weights = load_weights(self.model_dir, cfg, weights_dtype(self.kind, cfg))
        options = {} if self.kind == "cpu" else {"max_rows": self.step_rows, "max_logit_rows": self.logit_rows,
                                                 "max_table": 2 * self.logit_rows * self.max_blocks}
        self.model = make_backend(cfg, weights, spec, backend=self.kind, **options)
        self.num_blocks = spec.num_blocks
        self.lock = threading.Lock()

    def likelihoods(self, heads: list[list[int]], parts: list[list[int]]) -> np.ndarray:
        """float64 [parts, heads]: each part's summed token log-probabilities after each head. Tools go in groups
        that fit a step; for each group one step computes the heads (their last row predicts every part's first
        token) and a second the parts, each part's rows attending to its head's blocks, the head's last partial
        block copied in (no head is computed twice, and a row never depends on the others in its step)."""
        out = np.zeros((len(parts), len(heads)))
        per_tool = sum(len(p) for p in parts)
        with self.lock:
            group: list[int] = []
            for h in range(len(heads)):
                grown = group + [h]
                if group and not self._fits(grown, heads, parts, per_tool):
                    self._group(group, heads, parts, out)
                    grown = [h]
                group = grown
            self._group(group, heads, parts, out)
        return out

    def _fits(self, group: list[int], heads, parts, per_tool: int) -> bool:
        rows = sum(len(heads[h]) for h in group) + len(group) * per_tool
        blocks = sum(-(-len(heads[h]) // BLOCK) + sum(-(-(len(heads[h]) % BLOCK + len(p)) // BLOCK) for p in parts)
                     for h in group)
        return (rows <= self.step_rows and len(group) * per_tool <= self.logit_rows and blocks <= self.num_blocks
                and len(group) * len(parts) <= self.logit_rows)

    def _group(self, group: list[int], heads, parts, out) -> None:
        tables = np.full((len(group) * (1 + len(parts)), self.max_blocks), -1, np.int32)
        free = 0
        chunks, logit_rows, targets, rows = [], [], [], 0
        for slot, h in enumerate(group):
            n = len(heads[h])
            tables[slot, :-(-n // BLOCK)] = np.arange(free, free + -(-n // BLOCK))
            free += -(-n // BLOCK)
            chunks.append((slot, heads[h], 0))
            rows += n
            logit_rows += [rows - 1] * len(parts)   # the head's last row predicts each part's first token
            targets += [p[0] for p in parts]
        heads_step = replace(StepBatch.from_chunks(chunks, tables), logit_rows=np.asarray(logit_rows, np.int32))
        logp = self._run(heads_step, targets)
        for slot, h in enumerate(group):
            out[:, h] = logp[slot * len(parts):(slot + 1) * len(parts)]
        tokens, slots, positions, logit_rows, targets, owners = [], [], [], [], [], []
        for slot, h in enumerate(group):
            n, full = len(heads[h]), len(heads[h]) // BLOCK
            for p, part in enumerate(parts):
                if len(part) < 2:
                    continue
                row = len(group) + slot * len(parts) + p
                own = -(-(n + len(part) - 1) // BLOCK) - full
                tables[row, :full] = tables[slot, :full]
                tables[row, full:full + own] = np.arange(free, free + own)
                if n % BLOCK:
                    self.model.copy_kv(int(tables[slot, full]), free, n % BLOCK)
                free += own
                logit_rows += range(len(tokens), len(tokens) + len(part) - 1)
                tokens += part[:-1]
                slots += [row] * (len(part) - 1)
                positions += range(n, n + len(part) - 1)
                targets += part[1:]
                owners += [(p, h)] * (len(part) - 1)
        if tokens:
            batch = StepBatch(*(np.asarray(a, np.int32) for a in (tokens, slots, positions, tables, logit_rows)))
            logp = self._run(batch, targets)
            for (p, h), value in zip(owners, logp):
                out[p, h] += value

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

"""Continuous batching: admit requests while KV blocks and slots last, then build each step's rows.

Admission reserves a sequence's worst case (prompt + k pointers at the trie's deepest, and the jobs of the
tool lines it lists that are not kept: engine/lines.py) up front, so a sequence never runs out of cache
mid-answer. A step's rows are every decoding sequence's next tokens first (one, or the run its answer forces),
then prefill chunks (at most `chunk_size` tokens each, `max_step_tokens` in all), so a long prompt is spread
over several steps and never stalls the decoding requests.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from decoder_service.engine.block_manager import BlockManager
from decoder_service.engine.lines import Line, Lines
from decoder_service.engine.sequence import Sequence, State

_NO_BLOCKS = np.empty(0, np.int32)


class Scheduler:
    def __init__(self, blocks: BlockManager, block_size: int, max_seqs: int, chunk_size: int,
                 max_step_tokens: int, lines: Lines | None = None, max_table: int | None = None):
        self.blocks, self.block_size, self.lines = blocks, block_size, lines
        self.max_table = max_table   # a step's block-table entries at most (the GPU's buffer; None: any)
        self.free_slots = deque(range(max_seqs))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.chunk_size, self.max_step_tokens = chunk_size, max_step_tokens

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def own_blocks_needed(self, seq: Sequence) -> int:
        shared = 0 if seq.warmup else len(seq.catalog.shared_blocks)
        return -(-seq.max_positions() // self.block_size) - shared

    def admit(self, now: float) -> list[Sequence]:
        """Move waiting requests to running, oldest first, while a slot and their blocks are free (kept lines
        dropped for them where that frees enough); with each, the jobs of its lines not kept yet."""
        admitted = []
        for seq in list(self.waiting):
            if not self.free_slots:
                break
            if not (seq.warmup or seq.catalog.ready.is_set()):
                continue  # its catalog's prefix is still warming; later requests may go ahead
            need = own = self.own_blocks_needed(seq)
            if seq.line_keys:
                need += sum(self.lines.blocks_for(seq.catalog.tail_tokens, key)
                            for key in self.lines.missing(seq.line_keys))
            if need > self.blocks.num_free and not (self.lines and self.lines.make_room(need, seq.line_keys)):
                break  # oldest first: nobody overtakes a request waiting for blocks
            self.waiting.remove(seq)
            seq.slot = self.free_slots.popleft()
            self._start(seq, self.blocks.allocate(own), now)
            admitted.append(seq)
            if seq.line_keys:
                seq.lines, new = self.lines.take(seq.line_keys)
                self.lines.pin(seq.lines)
                admitted += self.line_jobs(seq.catalog, new, now)
        return admitted

    def _start(self, seq: Sequence, blocks: list[int], now: float) -> None:
        seq.blocks = blocks
        if not seq.warmup:
            self.blocks.share(seq.catalog.shared_blocks)
            seq.computed = seq.catalog.shared_tokens
        seq.state, seq.t_admit = State.PREFILL, now
        self.running.append(seq)

    def line_jobs(self, rt, lines: list[Line], now: float) -> list[Sequence]:
        """The prefills that compute new lines after their version's prefix, running (no slot: they sample nothing)."""
        jobs = []
        for line in lines:
            job = Sequence(request_id=f"line:{rt.key[0]}:v{rt.key[1]}", catalog=rt,
                           prompt_ids=rt.prefix_ids + list(line.tokens), k=0, allow=_NO_BLOCKS, allow_all=True,
                           line=line, on_finish=lambda line=line: self.lines.forget(line))
            self._start(job, self.blocks.allocate(self.lines.blocks_for(rt.tail_tokens, line.key)), now)
            jobs.append(job)
        return jobs

    def release(self, seq: Sequence) -> None:
        """Give back a finished or cancelled sequence's slot and blocks (its share of the prefix too)."""
        if seq in self.running:
            self.running.remove(seq)
            self.blocks.release(seq.blocks)
            if not seq.warmup:
                self.blocks.release(seq.catalog.shared_blocks)
            if seq.slot >= 0:
                self.free_slots.append(seq.slot)
            seq.blocks, seq.slot = [], -1
            if seq.lines:
                self.lines.unpin(seq.lines)
                seq.lines = []
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def prefix_blocks(self, seq: Sequence) -> np.ndarray:
        """The blocks before the sequence's own in its block table: its catalog's shared prefix (none for
        the warm-up that computes that prefix)."""
        return _NO_BLOCKS if seq.warmup else seq.catalog.shared_blocks

    def plan(self) -> list[tuple[Sequence, list[int], int]]:
        """This step's chunks: (sequence, tokens, first position), decodes first (each its generated tokens not
        yet fed: one, or a forced run), then prefill."""
        chunks, budget, width = [], self.max_step_tokens, 0
        for seq in self.running:
            if seq.state == State.DECODE and budget > 0 and seq.fed < len(seq.generated):
                toks = seq.generated[seq.fed:seq.fed + budget]
                chunks.append((seq, toks, len(seq.prompt_ids) + seq.fed))
                budget -= len(toks)
                width = max(width, self.table_width(seq))
        # requests and the lines they wait for first, then a version's warm-up (lines nobody waits for yet)
        prefills = [seq for seq in self.running if seq.state == State.PREFILL and not seq.lines]   # (lines: copied)
        for seq in sorted(prefills, key=lambda seq: bool(seq.line) and not seq.line.pins):
            width = max(width, self.table_width(seq))
            if budget <= 0 or self.max_table and (len(chunks) + 1) * width > self.max_table:
                break   # line jobs have no slot: a step may hold more chunks than max_seqs
            n = min(self.chunk_size, budget, len(seq.prompt_ids) - seq.computed)
            chunks.append((seq, seq.prompt_ids[seq.computed:seq.computed + n], seq.computed))
            budget -= n
        return chunks

    def table_width(self, seq: Sequence) -> int:
        """The blocks of the sequence's row of a step's block tables."""
        return len(self.prefix_blocks(seq)) + len(seq.blocks)

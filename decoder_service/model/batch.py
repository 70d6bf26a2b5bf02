"""StepBatch: one ragged forward step.

Each row is one token of one sequence at one absolute position, so a single step can mix prefill
chunks of several prompts with single decode tokens of others (continuous batching). The rows of
a sequence need not be contiguous or ordered; a row attends to positions 0..positions[row] of its
own sequence, whose K/V live in the paged pool at the blocks its block table names.

The first `decode_rows` rows are generated tokens, the others prompt rows. A backend may compute the
two kinds differently (the CUDA backend's attention does: one row at a time, or a chunk's rows
together); a row's result then depends on its kind, which the request fixes, never on the batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .config import ModelError


@dataclass(frozen=True)
class StepBatch:
    tokens: np.ndarray        # int32 [R] token id of each row
    slots: np.ndarray         # int32 [R] sequence slot of each row (a row of block_tables)
    positions: np.ndarray     # int32 [R] absolute position of the row in its sequence
    block_tables: np.ndarray  # int32 [S, max_blocks]: position p of slot s is in block
                              #   block_tables[s, p // block_size], offset p % block_size; unused -1
    logit_rows: np.ndarray    # int32 [N] rows whose final hidden state feeds a head
    decode_rows: int = 0      # rows 0..decode_rows-1 are generated tokens, the rest prompt rows

    @property
    def num_rows(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_chunks(cls, chunks: Sequence[tuple[int, Sequence[int], int]],
                    block_tables: np.ndarray, decode_rows: int = 0) -> "StepBatch":
        """Rows for `chunks` of (slot, tokens, first position); each chunk's last row gets logits.

        A decode step is a chunk of one token; a prefill is a chunk of the prompt (or a piece of it).
        The first `decode_rows` chunks are decode steps.
        """
        tokens, slots, positions, logit_rows = [], [], [], []
        for slot, toks, start in chunks:
            tokens.extend(toks)
            slots.extend([slot] * len(toks))
            positions.extend(range(start, start + len(toks)))
            logit_rows.append(len(tokens) - 1)
        i32 = lambda a: np.ascontiguousarray(a, dtype=np.int32)  # noqa: E731
        return cls(i32(tokens), i32(slots), i32(positions), i32(block_tables), i32(logit_rows), decode_rows)

    def validate(self, block_size: int, num_blocks: int, vocab_size: int) -> None:
        """Refuse a batch the kernels would read or write out of bounds (cheap, host-side)."""
        r = self.num_rows
        for name in ("tokens", "slots", "positions", "block_tables", "logit_rows"):
            a = getattr(self, name)
            if a.dtype != np.int32 or not a.flags.c_contiguous:
                raise ModelError(f"StepBatch.{name}: must be a C-contiguous int32 array, got {a.dtype}")
        if self.slots.shape != (r,) or self.positions.shape != (r,) or self.block_tables.ndim != 2:
            raise ModelError(f"StepBatch: tokens/slots/positions must all be [{r}], block_tables 2-D")
        if r == 0:
            raise ModelError("StepBatch: no rows")
        if not 0 <= self.decode_rows <= r:
            raise ModelError(f"StepBatch.decode_rows: must be in [0, {r}], got {self.decode_rows}")
        if self.tokens.min() < 0 or self.tokens.max() >= vocab_size:
            raise ModelError(f"StepBatch.tokens: ids must be in [0, {vocab_size})")
        if self.slots.min() < 0 or self.slots.max() >= len(self.block_tables):
            raise ModelError(f"StepBatch.slots: must index block_tables' {len(self.block_tables)} rows")
        if self.positions.min() < 0:
            raise ModelError("StepBatch.positions: must be >= 0")
        if self.logit_rows.ndim != 1 or (len(self.logit_rows) and
                                         (self.logit_rows.min() < 0 or self.logit_rows.max() >= r)):
            raise ModelError(f"StepBatch.logit_rows: must be row indices in [0, {r})")
        # Every position 0..max of every slot used must map to a valid block (one pass over the
        # table: a per-slot loop cost ~1 ms a step at 256 decode rows).
        last = np.full(len(self.block_tables), -1, np.int64)
        np.maximum.at(last, self.slots, self.positions)
        need = np.where(last >= 0, last // block_size + 1, 0)
        width = self.block_tables.shape[1]
        used = np.arange(width) < need[:, None]
        bad_entry = used & ((self.block_tables < 0) | (self.block_tables >= num_blocks))
        bad = (need > width) | bad_entry.any(axis=1)
        if bad.any():
            slot = int(np.argmax(bad))
            blocks = self.block_tables[slot, : need[slot]]
            raise ModelError(f"StepBatch.block_tables[{slot}]: positions up to {last[slot]} need "
                             f"{need[slot]} valid block ids in [0, {num_blocks}), got {blocks.tolist()}")
        keys = self.slots.astype(np.int64) << 32 | self.positions
        if len(np.unique(keys)) != r:
            raise ModelError("StepBatch: two rows write the same (slot, position)")

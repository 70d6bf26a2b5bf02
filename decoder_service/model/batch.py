"""StepBatch: one ragged forward step (continuous batching).

Each row is one token of one sequence at one absolute position, so a step mixes prefill chunks with decode
rows; the first `decode_rows` rows are generated tokens, and a row's result depends on its kind, never on the
batch (docs/model_runtime_interface.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from numba import njit

from .config import ModelError

_TOKEN, _SLOT, _POSITION, _LOGIT_ROW, _TABLE, _REPEAT = range(1, 7)


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

        A decode chunk is a sequence's generated tokens not yet fed (one, or a forced run); a prefill chunk is
        the prompt or a piece of it. The first `decode_rows` rows are the decode chunks'.
        """
        tokens, slots, positions, logit_rows = [], [], [], []
        for slot, toks, start in chunks:
            tokens.extend(toks)
            slots.extend([slot] * len(toks))
            positions.extend(range(start, start + len(toks)))
            logit_rows.append(len(tokens) - 1)

        def i32(a):
            return np.ascontiguousarray(a, dtype=np.int32)

        return cls(i32(tokens), i32(slots), i32(positions), i32(block_tables), i32(logit_rows), decode_rows)

    def validate(self, block_size: int, num_blocks: int, vocab_size: int) -> None:
        """Refuse a batch the kernels would read or write out of bounds (cheap, host-side)."""
        r = self.num_rows
        for name in ("tokens", "slots", "positions", "block_tables", "logit_rows"):
            a = getattr(self, name)
            if a.dtype != np.int32 or not a.flags.c_contiguous:
                raise ModelError(f"StepBatch.{name}: must be a C-contiguous int32 array, got {a.dtype}")
        if (self.tokens.ndim != 1 or self.slots.shape != (r,) or self.positions.shape != (r,)
                or self.block_tables.ndim != 2):
            raise ModelError(f"StepBatch: tokens/slots/positions must all be [{r}], block_tables 2-D")
        if self.logit_rows.ndim != 1:
            raise ModelError(f"StepBatch.logit_rows: must be row indices in [0, {r})")
        if r == 0:
            raise ModelError("StepBatch: no rows")
        if not 0 <= self.decode_rows <= r:
            raise ModelError(f"StepBatch.decode_rows: must be in [0, {r}], got {self.decode_rows}")
        fault, at = _first_fault(self.tokens, self.slots, self.positions, self.block_tables, self.logit_rows,
                                 block_size, num_blocks, vocab_size)
        if fault == _TOKEN:
            raise ModelError(f"StepBatch.tokens: ids must be in [0, {vocab_size})")
        if fault == _SLOT:
            raise ModelError(f"StepBatch.slots: must index block_tables' {len(self.block_tables)} rows")
        if fault == _POSITION:
            raise ModelError("StepBatch.positions: must be >= 0")
        if fault == _LOGIT_ROW:
            raise ModelError(f"StepBatch.logit_rows: must be row indices in [0, {r})")
        if fault == _TABLE:
            last = int(self.positions[self.slots == at].max())
            need = last // block_size + 1
            raise ModelError(f"StepBatch.block_tables[{at}]: positions up to {last} need {need} valid block ids "
                             f"in [0, {num_blocks}), got {self.block_tables[at, :need].tolist()}")
        if fault == _REPEAT:
            raise ModelError("StepBatch: two rows write the same (slot, position)")


@njit(cache=True)
def _first_fault(tokens, slots, positions, block_tables, logit_rows, block_size, num_blocks, vocab_size):
    """(what is wrong, the slot it concerns) for the first fault found, or (0, 0): one compiled pass,
    since every step pays for it before the device has work (numpy's dozen calls took 0.1–0.2 ms on
    the H200's host: P61). Every position 0..max of each slot used must map to a valid block, and no two rows
    may write the same (slot, position)."""
    for t in tokens:
        if t < 0 or t >= vocab_size:
            return _TOKEN, 0
    S = block_tables.shape[0]
    last = np.full(S, -1, np.int64)
    for i in range(len(slots)):
        if slots[i] < 0 or slots[i] >= S:
            return _SLOT, 0
        if positions[i] < 0:
            return _POSITION, 0
        last[slots[i]] = max(last[slots[i]], positions[i])
    for row in logit_rows:
        if row < 0 or row >= len(tokens):
            return _LOGIT_ROW, 0
    for s in range(S):
        need = last[s] // block_size + 1 if last[s] >= 0 else 0
        if need > block_tables.shape[1]:
            return _TABLE, s
        for b in range(need):
            if block_tables[s, b] < 0 or block_tables[s, b] >= num_blocks:
                return _TABLE, s
    keys = np.sort((slots.astype(np.int64) << 32) | positions)
    for i in range(1, len(keys)):
        if keys[i] == keys[i - 1]:
            return _REPEAT, 0
    return 0, 0

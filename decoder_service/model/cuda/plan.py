"""The step's launch plan on the host: which kernel takes which rows, a property of each row, never of the batch."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from ..batch import StepBatch
from .attention import TP

_NO_TILES = np.empty((0, 3), np.int32)
# a step's prompt rows from which each matrix takes k_gemm's big tiles (P85; per matrix, P90; None: never), and
# below those, its small tiles on one register set (P98)
GEMM_BIG_FROM = {"qkv": 1024, "o": None, "gate_up": 128, "down": 128}
GEMM_ONE_FROM = {"qkv": 128, "o": 128, "gate_up": None, "down": None}


def attention_plan(batch: StepBatch, max_ctx: int, tile_from: int, rows_per_tile: int, split: int,
                   most_splits: int, unit: int) -> tuple[np.ndarray, np.ndarray]:
    """Which attention kernel takes each row, a property of the row alone (its kind and position),
    never of the batch: (rows for k_attn_rows, int32 [n]; row tiles for k_attn_tiles, int32 [tiles, 3]
    of (first row, rows, split)). Prompt rows at positions >= tile_from go in tiles: runs of consecutive
    rows of one sequence at consecutive positions and of one split (prompt_split's), cut every
    rows_per_tile rows; where a cut falls changes nothing a row computes, only how many rows share a K/V
    read. max_ctx is the batch's largest position + 1 (a step of decode rows, or of short contexts only,
    skips the tile search)."""
    R = batch.num_rows
    if batch.decode_rows == R or max_ctx <= tile_from:
        return np.arange(R, dtype=np.int32), _NO_TILES
    return _cut_tiles(batch.slots, batch.positions, batch.decode_rows, tile_from, rows_per_tile, split,
                      most_splits, unit)


@njit(cache=True)
def prompt_split(n, split, most_splits, unit):
    """The positions a split of a prompt row's context of n positions holds: `split`, or where that
    would cut the context into more than most_splits, the least multiple of `unit` that does not (a
    row's tile attention runs one block per split: fewer, longer blocks fit one wave of the GPU;
    P63). A function of the row's position alone, so a row computes the same bits in any batch or
    chunk. (`unit` is an argument, not kernels.TP: numba's disk cache keeps a global's value:
    P63, docs/gpu.md#what-numbas-code-generation-adds.)"""
    return max(split, -(-n // (unit * most_splits)) * unit)


@njit(cache=True)
def _cut_tiles(slots, positions, decode_rows, tile_from, rows_per_tile, split, most_splits, unit):
    """attention_plan's tile search in one compiled pass (a prefill step waits for it before the device
    has work): a tiled row continues its predecessor's run where it is the next row, of the same slot, at
    the next position, with the same split; a tile starts at every rows_per_tile-th row of a run."""
    R = len(slots)
    rows, tiles = np.empty(R, np.int32), np.empty((R, 3), np.int32)
    n_rows = n_tiles = 0
    offset, prev = 0, -2
    for i in range(R):
        if i < decode_rows or positions[i] < tile_from:
            rows[n_rows] = i
            n_rows += 1
            continue
        own = prompt_split(positions[i] + 1, split, most_splits, unit)
        runs_on = i == prev + 1 and slots[i] == slots[prev] and positions[i] == positions[prev] + 1 \
            and own == tiles[n_tiles - 1, 2]
        offset = offset + 1 if runs_on else 0
        prev = i
        if offset % rows_per_tile == 0:
            tiles[n_tiles, 0], tiles[n_tiles, 1], tiles[n_tiles, 2] = i, 1, own
            n_tiles += 1
        else:
            tiles[n_tiles - 1, 1] += 1
    return rows[:n_rows], tiles[:n_tiles]


def compile_step_helpers(block_size: int, num_blocks: int, vocab_size: int, rows_per_tile: int, split: int,
                         most_splits: int) -> None:
    """Compile a step's host helpers (StepBatch.validate's check, attention_plan's tile search: numba,
    cached on disk) for the argument types a step passes them, now: on a cold cache they take ~2 s, which
    the first step, a catalog's warm-up, would otherwise wait for (P73)."""
    batch = StepBatch.from_chunks([(0, [0, 0], 0)], np.zeros((1, 1), np.int32))
    batch.validate(block_size, num_blocks, vocab_size)
    attention_plan(batch, 2, 0, rows_per_tile, split, most_splits, TP)


def gemm_kind(rows: int, big_from: int | None, one_from: int | None) -> str:
    """A matrix's k_gemm tiles for a step of `rows` prompt rows (GEMM_KINDS): big from big_from rows, else small on
    one register set from one_from, else small (None: never)."""
    if big_from is not None and rows >= big_from:
        return "big"
    return "one" if one_from is not None and rows >= one_from else "small"


class RowPlan(NamedTuple):
    """How a step's rows go through the four matrices of every layer (CudaBackend.row_plan)."""
    gemv: dict     # layer key of each matrix's GEMV launch: the one-row kernel or row tiles
    tiles: int     # GEMV row tiles (the one-row kernel counts as one; 0: no GEMV rows)
    prompt: int    # rows on the tensor cores (k_gemm; 0: none)
    gemm: dict     # layer key of each matrix's k_gemm launch: its tiles (GEMM_KINDS)
    rope: bool     # k_rope_kv runs (else RoPE and the KV write ran in the one-row QKV GEMV)

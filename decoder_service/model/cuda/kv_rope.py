"""Device helpers the kernel families share: a position's address in the paged KV pool, RoPE's rotation of a pair."""
from __future__ import annotations

import numpy as np

from decoder_service.gpu.intrinsics import divmod_u32

from numba import cuda


@cuda.jit(device=True, inline="always")
def kv_base(bt, mb, slot, pos, bs, layer_off, rowlen, kvh, hd):
    """Element offset of (layer, position `pos` of sequence `slot`, kv head) in the paged pool, or -1
    where the block table has no block there."""
    i, o = divmod_u32(pos, bs)
    blk = bt[np.int64(slot) * mb + i]
    if blk < 0:
        return np.int64(-1)
    return layer_off + (np.int64(blk) * bs + o) * rowlen + kvh * hd


@cuda.jit(device=True, inline="always")
def rope_pair(a, b, cs, pos, half, i):
    """RoPE of the rotate_half pair (a, b) = (x[i], x[i + hd/2]) at position pos (table cs)."""
    j = 2 * (np.int64(pos) * half + i)
    c = cs[j]
    s = cs[j + 1]
    return a * c - b * s, b * c + a * s

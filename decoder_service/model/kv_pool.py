"""The paged KV pool: its size, and (for host backends) its arrays.

The pool is a fixed set of blocks of `block_size` token slots, per layer, for keys and values:
`k[L, num_blocks, block_size, n_kv_heads, head_dim]` (same for `v`). It is sized once, at start-up,
from a token count or from a fraction of the memory available, and never grows inside a step: the
engine's block manager hands out its blocks and admission guarantees a sequence never runs out.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import ModelConfig, ModelError
from .weights import available_host_memory

DEFAULT_BLOCK_SIZE = 16


def bytes_per_token(cfg: ModelConfig, dtype) -> int:
    """K and V of one token position over all layers."""
    return 2 * cfg.num_layers * cfg.kv_size * np.dtype(dtype).itemsize


@dataclass(frozen=True)
class KVPoolSpec:
    num_blocks: int
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self):
        if self.num_blocks < 1 or self.block_size < 1:
            raise ModelError(f"KV pool: num_blocks={self.num_blocks} and block_size={self.block_size} "
                             f"must both be >= 1")

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def capacity_sequences(self, seq_len: int) -> int:
        """How many sequences of `seq_len` tokens fit at once (each owns whole blocks)."""
        return self.num_blocks // -(-seq_len // self.block_size)

    def nbytes(self, cfg: ModelConfig, dtype) -> int:
        return self.capacity_tokens * bytes_per_token(cfg, dtype)

    @classmethod
    def from_tokens(cls, tokens: int, block_size: int = DEFAULT_BLOCK_SIZE) -> "KVPoolSpec":
        """Room for at least `tokens` token positions."""
        return cls(-(-tokens // block_size), block_size)

    @classmethod
    def from_memory_fraction(cls, cfg: ModelConfig, fraction: float, dtype,
                             block_size: int = DEFAULT_BLOCK_SIZE,
                             available_bytes: int | None = None) -> "KVPoolSpec":
        """As many blocks as fit in `fraction` of `available_bytes` (default: the host's free RAM;
        a GPU backend passes the device's free memory)."""
        if not 0 < fraction <= 1:
            raise ModelError(f"KV pool: memory fraction {fraction} must be in (0, 1]")
        avail = available_host_memory() if available_bytes is None else available_bytes
        per_block = block_size * bytes_per_token(cfg, dtype)
        blocks = int(avail * fraction) // per_block
        if blocks < 1:
            raise ModelError(f"KV pool: {fraction:.0%} of {avail / 2**20:.1f} MiB available holds no "
                             f"block of {per_block / 2**20:.2f} MiB ({block_size} tokens)")
        return cls(blocks, block_size)


@dataclass
class HostKVPool:
    """K/V arrays in host memory, for the CPU backend and the reference."""

    spec: KVPoolSpec
    k: np.ndarray  # [L, num_blocks, block_size, n_kv_heads, head_dim]
    v: np.ndarray

    @classmethod
    def allocate(cls, cfg: ModelConfig, spec: KVPoolSpec, dtype) -> "HostKVPool":
        need, avail = spec.nbytes(cfg, dtype), available_host_memory()
        if need > avail:
            raise ModelError(f"KV pool of {spec.num_blocks} blocks x {spec.block_size} tokens needs "
                             f"{need / 2**30:.2f} GiB as {np.dtype(dtype).name}, only "
                             f"{avail / 2**30:.2f} GiB of RAM available")
        shape = (cfg.num_layers, spec.num_blocks, spec.block_size, cfg.num_kv_heads, cfg.head_dim)
        return cls(spec, np.zeros(shape, dtype), np.zeros(shape, dtype))

    def copy_positions(self, src_block: int, dst_block: int, count: int) -> None:
        """K/V of a block's first `count` positions, every layer, into another block's (copy_kv)."""
        self.k[:, dst_block, :count] = self.k[:, src_block, :count]
        self.v[:, dst_block, :count] = self.v[:, src_block, :count]

    def place(self, src: np.ndarray, dst: np.ndarray, shift: np.ndarray, rotate) -> None:
        """K/V of the pool slots `src` (block * block_size + offset), every layer, into the slots `dst`, each key
        rotated `shift` positions further (place_kv); rotate(keys [n, n_kv, d], shift) -> the rotated keys, in the
        backend's precision."""
        L, heads = self.k.shape[0], self.k.shape[3:]
        k, v = self.k.reshape(L, -1, *heads), self.v.reshape(L, -1, *heads)
        for layer in range(L):
            k[layer, dst] = rotate(k[layer, src], shift)
            v[layer, dst] = v[layer, src]

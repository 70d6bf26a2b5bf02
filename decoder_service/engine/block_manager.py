"""The paged KV pool's blocks: who holds which, with reference counts for shared prefix blocks."""
from __future__ import annotations

from collections import deque

import numpy as np


class BlockManager:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free = deque(range(num_blocks))
        self.refs = np.zeros(num_blocks, dtype=np.int32)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks, each with one reference; the caller checked num_free first."""
        if n > len(self.free):
            raise MemoryError(f"{n} KV blocks asked for, {len(self.free)} free")
        blocks = [self.free.popleft() for _ in range(n)]
        self.refs[blocks] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        self.refs[blocks] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks nobody holds go back to the free list."""
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(int(b))
            elif self.refs[b] < 0:
                raise RuntimeError(f"KV block {b} released more often than held")

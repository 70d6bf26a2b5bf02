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

    def share(self, blocks) -> None:
        """One more reference to each of these distinct blocks (a catalog's prefix, per request)."""
        self.refs[blocks] += 1

    def release(self, blocks) -> None:
        """Drop one reference to each of these distinct blocks; those nobody holds go back to the free
        list, in the order given. Vectorised: a request on a 4,955-token catalog holds 310 prefix
        blocks, and a Python loop over them cost every answer ~0.2 ms on the H200's host (P53).
        A block released more often than held raises and leaves every count as it was."""
        blocks = np.asarray(blocks, np.intp)
        if blocks.size == 0:
            return
        self.refs[blocks] -= 1
        left = self.refs[blocks]
        if left.min() < 0:
            self.refs[blocks] += 1
            raise RuntimeError(f"KV block {int(blocks[np.argmax(left < 0)])} released more often than held")
        self.free.extend(blocks[left == 0].tolist())

    def consistent(self) -> bool:
        """The pool's invariant: every block is either free (no reference, listed once) or held."""
        free = np.asarray(self.free, np.intp)
        held = int(np.count_nonzero(self.refs > 0))
        return (len(free) + held == self.num_blocks and len(np.unique(free)) == len(free)
                and not np.any(self.refs[free] != 0) and not np.any(self.refs < 0))

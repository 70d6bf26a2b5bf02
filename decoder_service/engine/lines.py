"""Tool-line KV: each tool's prompt line computed once, after its version's prefix, and kept for every request.

Of a request's prompt, the shortlist's lines are most of the tokens and the same in every request that lists those
tools. With line KV on, a line attends to the prefix and to itself only, at its canonical place (right after the
prefix), so its K/V is the same in every prompt: it is computed once (a line job: a prefill of the prefix's tail
copy and the line), kept in the engine's KV pool, and each request that lists it gets a copy in its own blocks, its
keys rotated to where its prompt puts it (`backend.place_kv`). The request then prefills only the rest: the intent,
k and the assistant header, which attend to everything. Kept lines use blocks the pool has free, least recently
listed dropped first when a request needs them. The selector is trained with the same attention (docs/quality.md).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from decoder_service.engine.block_manager import BlockManager


@dataclass(eq=False)
class Line:
    """One tool line's K/V after one prefix."""
    key: tuple                 # (the prefix's tokens, the line's tokens with its newline)
    blocks: list[int] = field(default_factory=list)   # block 0: the prefix's tail (copied), then the line's rows
    ready: bool = False        # its job's step was read
    pins: int = 0              # requests that will copy it

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.key[1]


class Lines:
    """The kept lines, least recently listed first, in blocks of the engine's pool."""

    def __init__(self, blocks: BlockManager, block_size: int):
        self.pool, self.block_size = blocks, block_size
        self.kept: OrderedDict[tuple, Line] = OrderedDict()

    def blocks_for(self, tail: int, key: tuple) -> int:
        """Blocks a line's job holds: the prefix's tail, then the line."""
        return -(-(tail + len(key[1])) // self.block_size)

    def missing(self, keys: list[tuple]) -> list[tuple]:
        """The keys not kept (nor being computed)."""
        return [key for key in dict.fromkeys(keys) if key not in self.kept]

    def take(self, keys: list[tuple]) -> tuple[list[Line], list[Line]]:
        """(the lines of `keys`, in order, now the most recently listed; those new, whose jobs the caller starts)."""
        lines, new = [], []
        for key in keys:
            line = self.kept.get(key)
            if line is None:
                line = self.kept[key] = Line(key)
                new.append(line)
            self.kept.move_to_end(key)
            lines.append(line)
        return lines, new

    @staticmethod
    def pin(lines: list[Line]) -> None:
        """Keep the lines until `unpin`: a request copies them in first."""
        for line in lines:
            line.pins += 1

    @staticmethod
    def unpin(lines: list[Line]) -> None:
        for line in lines:
            line.pins -= 1

    def forget(self, line: Line) -> None:
        """A line whose job ended without computing it (the engine stopped): it is no longer kept."""
        if not line.ready and self.kept.get(line.key) is line:
            del self.kept[line.key]

    def make_room(self, need: int, keep: list[tuple] | None) -> bool:
        """Drop unpinned kept lines but those of `keep`, least recently listed first, until `need` blocks are free;
        whether they are."""
        keep = set(keep or ())
        for key in [key for key, line in self.kept.items() if line.ready and not line.pins and key not in keep]:
            if self.pool.num_free >= need:
                break
            self.pool.release(self.kept.pop(key).blocks)
        return self.pool.num_free >= need

    def slots(self, line: Line, tail: int, count: int) -> np.ndarray:
        """int32 pool slots of the line's first `count` rows."""
        at = tail + np.arange(count)
        return (np.asarray(line.blocks, np.int32)[at // self.block_size] * self.block_size
                + at % self.block_size).astype(np.int32)

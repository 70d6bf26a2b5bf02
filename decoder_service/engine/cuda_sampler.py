"""The engine's sampler on a GPU backend: the pick runs on the device (device_trie.DeviceTrie: k_mask, the
backend's sparse head, k_select), so that the engine can launch the next step before the host reads the picks."""
from __future__ import annotations

from typing import NamedTuple

from decoder_service.engine.device_trie import DeviceTrie
from decoder_service.engine.sampler import Pick, empty_mask_message


class DeviceSampler:
    """The engine's sampler on a GPU backend (sampler.Sampler), through a DeviceTrie over the backend's candidate
    buffers (`cand`, `ncand`, `sparse`: model/cuda/README.md) and its sparse head.

    The rows' trie state stays on the host (the engine's source of truth). `start` stages it, enqueues the pick
    and its copy out; `finish` waits for that copy. `follow` enqueues the same rows' next choice from the state
    k_select left on the device, before the host has read the previous picks (the engine's step ahead). A
    version is bound (made resident) when the engine is told it is the default or pinned (`bind`, at the
    version switch); one the engine was not told of is bound at its first step (`lazy_binds` counts those). A
    step the kernels cannot take whole (a node wider than the candidate buffer, a k or an allowlist past the
    staging buffers) goes to the host sampler, which tiles: no candidate is dropped.
    """

    def __init__(self, backend, fallback, max_k: int = 64, max_allow: int = 1 << 16, finish_forced: bool = True):
        """finish_forced: the engine's setting of that name (whether a last name left alone below its node
        ends the answer at the pick that enters it), so that the done flags say what the engine will."""
        self.fallback = fallback
        self.trie = DeviceTrie(stream=backend.stream, cand=backend.cand, ncand=backend.ncand, sparse=backend.sparse,
                               launch_sparse=backend.launch_sparse, rows=backend.max_logit_rows,
                               cmax=backend.max_candidates, max_k=max_k, max_allow=max_allow,
                               finish_forced=finish_forced)
        self.lazy_binds = 0   # versions bound inside a step (not bound at their switch)

    def bind(self, catalog, constant: bool = True) -> None:
        """Make a version resident on the device (constant: also in constant memory, where it fits)."""
        self.trie.bind(catalog.key, catalog.trie, constant)

    def forget(self, catalog) -> None:
        """A released version (DeviceTrie.release)."""
        self.trie.release(catalog.key)

    def start(self, seqs) -> "DevicePicks | list":
        """Enqueue the choice for `seqs` (their trie state staged from the host); the host sampler's
        picks, computed now, for a step the kernels cannot take whole."""
        t = self.trie
        allow_total = sum(len(s.allow) for s in seqs if not s.allow_all)
        if (len(seqs) > t.rows or allow_total > t.max_allow
                or any(most_candidates(s) > t.cmax or s.k > t.max_k for s in seqs)):
            return self.fallback.choose(seqs)
        for seq in seqs:
            if not t.holds(seq.catalog.key):
                t.bind(seq.catalog.key, seq.catalog.trie)
                self.lazy_binds += 1
        t.stage(seqs)
        return self._enqueue(seqs)

    def follow(self, picks: "DevicePicks") -> "DevicePicks":
        """Enqueue the next choice for the same rows from the trie state `picks`' k_select left on the
        device (node, emitted pointers): nothing is staged, so it may run before the host reads `picks`."""
        return self._enqueue(picks.seqs)

    def next_tokens(self, picks):
        """The device buffer holding the picked tokens (row i: row i's), for the next step's forward;
        None for picks made on the host, or staged before a version was bound since (their rows' placement
        may have moved: the engine does not step ahead of them). A row with no candidate holds token 0
        there, a valid id."""
        if not isinstance(picks, DevicePicks) or picks.epoch != self.trie.epoch:
            return None
        return self.trie.picked_tokens()

    def done_flags(self, picks):
        """The device buffer of whether each row's answer ended at `picks` (row i: row i's), for a step
        launched ahead of them to run only if some row is still live; None for picks made on the host."""
        return self.trie.done_flags() if isinstance(picks, DevicePicks) else None

    def _enqueue(self, seqs) -> "DevicePicks":
        return DevicePicks(seqs, self.trie.enqueue(len(seqs)), self.trie.epoch)

    def finish(self, picks) -> list:
        """Wait for enqueued picks (host-sampler picks are returned as they are): a Pick per row, or a
        message saying why there is none."""
        if not isinstance(picks, DevicePicks):
            return picks
        ok, token, edge, logprob = self.trie.read(picks.buffer, len(picks.seqs))
        return [Pick(int(edge[i]), int(token[i]), float(logprob[i])) if ok[i] else empty_mask_message(seq)
                for i, seq in enumerate(picks.seqs)]


def most_candidates(seq) -> int:
    """The most legal edges a row can have at any node: the trie's widest node, or with an allowlist (a
    shortlist) one edge per allowed pointer plus the two control edges, whichever is fewer."""
    if seq.allow_all:
        return seq.catalog.max_fanout
    return min(seq.catalog.max_fanout, len(seq.allow) + 2)


class DevicePicks(NamedTuple):
    """A choice enqueued on the device: its rows, the host buffers its picks arrive in, and the placement
    epoch its rows were staged in."""
    seqs: list
    buffer: int
    epoch: int

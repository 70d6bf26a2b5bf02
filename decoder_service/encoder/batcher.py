"""Batcher: the encoder calls of requests that arrive together run as one call."""
from __future__ import annotations

import threading

import numpy as np


class _Call:
    """One caller's texts and, once its batch has run, their vectors or the batch's error."""

    def __init__(self, seqs: list[np.ndarray]):
        self.seqs, self.done = seqs, False
        self.vectors: np.ndarray | None = None
        self.error: BaseException | None = None

    def result(self) -> np.ndarray:
        if self.error is not None:
            raise self.error
        return self.vectors


class Batcher:
    """A backend's `embed` (token id arrays -> vectors) shared by concurrent callers. A caller that finds no batch
    running runs its own texts and those of every caller waiting, in one call; the others wait for their rows.
    Alone, a caller runs its own call at once. A text's vector is the same bits in any batch (the encoders'
    contract), so whom a request shares a call with never shows in its answer; one call of many texts costs far
    less than many calls."""

    def __init__(self, backend):
        self._backend = backend
        self._cond = threading.Condition()
        self._waiting: list[_Call] = []
        self._running = False

    def __call__(self, seqs: list[np.ndarray]) -> np.ndarray:
        call = _Call(seqs)
        with self._cond:
            self._waiting.append(call)
            while self._running and not call.done:
                self._cond.wait()
            if call.done:
                return call.result()
            self._running = True
            batch, self._waiting = self._waiting, []
        try:
            vectors, error = self._backend.embed([s for c in batch for s in c.seqs]), None
        except BaseException as e:  # noqa: BLE001 - every caller of the batch gets it (raised there), not only this one
            vectors, error = None, e
        with self._cond:
            at = 0
            for c in batch:
                c.vectors = None if error else vectors[at:at + len(c.seqs)]
                c.error, c.done = error, True
                at += len(c.seqs)
            self._running = False
            self._cond.notify_all()
        return call.result()

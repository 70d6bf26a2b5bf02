"""Turns: a lock taken in the order it was asked for, so that a short job never waits behind all of a long one."""
from __future__ import annotations

import threading


class Turns:
    """A first-come, first-served lock (`with turns:`). A plain Lock lets its releaser take it straight back, so a
    job that takes it once per chunk (a catalog's tool vectors) would keep a request out until its last chunk;
    with Turns a request waits for the chunk under way, then goes."""

    def __init__(self):
        self._cond = threading.Condition()
        self._next = 0       # the ticket the next caller gets
        self._serving = 0    # the ticket whose turn it is
        self._gone = set()   # later tickets whose callers stopped waiting (an exception in wait): passed over

    def __enter__(self) -> "Turns":
        with self._cond:
            ticket = self._next
            self._next += 1
            try:
                while ticket != self._serving:
                    self._cond.wait()
            except BaseException:
                if ticket == self._serving:
                    self._pass_on()
                else:
                    self._gone.add(ticket)
                raise
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._pass_on()

    def _pass_on(self) -> None:
        """Give the turn to the next ticket whose caller still waits (under the condition's lock)."""
        self._serving += 1
        while self._serving in self._gone:
            self._gone.remove(self._serving)
            self._serving += 1
        self._cond.notify_all()

"""Turns: a lock taken in the order it was asked for, so that a short job never waits behind all of a long one."""
from __future__ import annotations

from threading import Event, Lock


class Turns:
    """A first-come, first-served lock (`with turns:`). A plain Lock lets its releaser take it straight back, so a
    job that takes it once per chunk (a catalog's tool vectors) would keep a request out until its last chunk;
    with Turns a request waits for the chunk under way, then goes. Each waiting caller has its own event, and
    passing the turn sets only the next one's: with one condition for all, every pass woke every waiting thread
    to find the next, each of them needing the GIL (P115)."""

    def __init__(self):
        self._lock = Lock()
        self._next = 0       # the ticket the next caller gets
        self._serving = 0    # the ticket whose turn it is
        self._waiting: dict[int, Event] = {}   # a waiting caller's ticket -> the event that wakes it
        self._gone = set()   # later tickets whose callers stopped waiting (an exception in wait): passed over

    def __enter__(self) -> "Turns":
        with self._lock:
            ticket = self._next
            self._next += 1
            if ticket == self._serving:
                return self
            event = self._waiting[ticket] = Event()
        try:
            event.wait()
        except BaseException:
            with self._lock:
                self._waiting.pop(ticket, None)
                if ticket == self._serving:    # its turn came as it stopped waiting
                    self._pass_on()
                else:
                    self._gone.add(ticket)
            raise
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._pass_on()

    def _pass_on(self) -> None:
        """Give the turn to the next ticket whose caller still waits, and wake that caller (under the lock)."""
        self._serving += 1
        while self._serving in self._gone:
            self._gone.remove(self._serving)
            self._serving += 1
        event = self._waiting.pop(self._serving, None)
        if event is not None:
            event.set()

"""A request and its sequence: prompt, trie state, emitted pointers, KV blocks, and its event stream.

Events go to a queue the caller iterates: Pointer events as each tool name completes, then Done, or
a single Failed. The engine thread is the only writer of a Sequence's fields.
"""
from __future__ import annotations

import enum
import queue
import time
from dataclasses import dataclass, field

import numpy as np

from decoder_service.engine.catalog_runtime import CatalogRuntime


class State(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclass(frozen=True)
class PointerEvent:
    index: int           # 0-based position in the answer
    pointer_id: int
    name: str
    token_ids: tuple[int, ...]
    logprob: float       # sum over the pointer's tokens (and its control token) of the constrained log-softmax


@dataclass(frozen=True)
class DoneEvent:
    prompt_tokens: int
    generated_tokens: int
    queue_ms: float
    prefill_ms: float
    decode_ms: float


@dataclass(frozen=True)
class FailedEvent:
    kind: str            # "internal", "cancelled", "deadline", "busy" (it would miss its deadline), "unavailable"
    message: str


@dataclass(eq=False)   # compared by identity: two live requests may carry the same id (a client's retry)
class Sequence:
    request_id: str
    catalog: CatalogRuntime
    prompt_ids: list[int]            # the full prompt: catalog prefix + the request's own suffix
    k: int
    allow: np.ndarray                # sorted allowed pointer ids (empty with allow_all)
    allow_all: bool
    prior: np.ndarray | None = None  # float32 beside allow: logits added for each allowed tool (fusion weight
                                     # times minus its retrieval rank); None: the generator alone
    deadline: float | None = None    # time.monotonic() after which the request fails
    warmup: bool = False             # a catalog prefix warm-up: prefill only, its blocks become shared
    line_keys: list = field(default_factory=list)   # its shortlist's kept lines (engine/lines.py), in prompt order
    line_rows: int = 0               # the prompt rows those lines fill (all but the last line's newline)
    line: object = None              # a line job: prefill only, its blocks become the kept Line's
    on_finish: object = None         # called once the engine has let go of the request (blocks released)
    events: queue.Queue = field(default_factory=queue.Queue)
    state: State = State.WAITING
    slot: int = -1
    blocks: list[int] = field(default_factory=list)       # own blocks (after the shared prefix ones)
    lines: list = field(default_factory=list)              # pinned lines to copy in before its prefill goes on
    computed: int = 0                # prompt positions whose KV is in the pool
    node: int = 0                    # current trie node
    emitted: np.ndarray = None       # pointer ids emitted so far (k slots)
    n_emitted: int = 0
    generated: list[int] = field(default_factory=list)
    fed: int = 0                     # generated tokens whose KV is in the pool or in a step launched
    pointer_tokens: list[int] = field(default_factory=list)
    pointer_logprob: float = 0.0
    cancelled: bool = False
    t_submit: float = field(default_factory=time.monotonic)
    t_admit: float = 0.0
    t_first_decode: float = 0.0

    def __post_init__(self):
        self.emitted = np.full(max(self.k, 1), -1, dtype=np.int32)

    def max_positions(self) -> int:
        """Worst-case KV positions: the prompt plus k pointers at the trie's deepest, each with its
        control token (the last one, stop, is never fed back, so this is an upper bound)."""
        if self.warmup:
            return len(self.prompt_ids)
        return len(self.prompt_ids) + self.k * self.catalog.max_output_tokens_per_pointer

    def may_stop(self) -> bool:
        """Could this step's token be the answer's stop (the last pointer, at a node with a stop edge)?"""
        return self.n_emitted + 1 == self.k and bool(self.catalog.stop_nodes[self.node])

    def finish(self, event) -> None:
        """The engine's last word on the request, after its KV blocks went back to the pool."""
        self.state = State.FINISHED
        on_finish, self.on_finish = self.on_finish, None
        if on_finish is not None:
            on_finish()
        self.events.put(event)

    def __iter__(self):
        """The caller's side: Pointer events, then Done; a Failed event ends the stream too."""
        while True:
            event = self.events.get()
            yield event
            if isinstance(event, (DoneEvent, FailedEvent)):
                return

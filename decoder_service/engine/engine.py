"""DecodeEngine: requests in, exactly k distinct catalog tool names out, streamed as they complete.

One engine owns one model backend, its KV pool and the device: `step()` is one continuous-batching step
(admit, one ragged forward pass, the trie-masked pick, advance), run by `start()`'s thread; `submit`,
`cancel`, `load_catalog` and `make_resident` may be called from any thread. A step's parts, the step ahead,
the forced tails and runs: docs/architecture.md ("The path of a request"); their figures: docs/performance.md
(P54, P57, P71, P102).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections import deque

import numpy as np

from decoder_service.engine.block_manager import BlockManager
from decoder_service.engine.catalog_runtime import CatalogRuntime
from decoder_service.engine.fusion import catalog_weight, rank_prior
from decoder_service.engine.lines import Lines
from decoder_service.engine.sampler import SEP, STOP, HostSampler, Pick, Sampler, forced_edge
from decoder_service.engine.scheduler import Scheduler
from decoder_service.engine.sequence import DoneEvent, FailedEvent, PointerEvent, Sequence, State
from decoder_service.model.batch import StepBatch
from decoder_service.retrieval.config import SHORTLIST
from decoder_service.retrieval.host import Retriever, Shortlist, bm25_index
from shared.trie import Trie, TrieWalkError

log = logging.getLogger("tooltrie.engine")
EXPIRY_SLACK = 0.01   # seconds: a request cancelled this close to its deadline was cancelled by it
SERVICE_SMOOTHING = 0.2   # the weight of the newest answer in the moving average of the service time
SERVICE_MARGIN = 1.25     # expected_seconds' margin: a request's time varies with the batch it runs in


def make_sampler(backend, head: str, finish_forced: bool) -> Sampler:
    """The device sampler for the sparse head on a GPU backend, the host sampler otherwise."""
    if head == "sparse" and getattr(backend, "name", "") == "cuda":
        from decoder_service.engine.cuda_sampler import DeviceSampler
        return DeviceSampler(backend, HostSampler(backend, head), finish_forced=finish_forced)
    return HostSampler(backend, head)


class RequestError(ValueError):
    """A request that cannot be served as asked (bad k, intent, allowlist); nothing was queued."""


class QueueFull(Exception):
    """The waiting queue is at its bound: the caller should back off (RESOURCE_EXHAUSTED)."""


class Expired(Exception):
    """The request's deadline passed before it was queued (DEADLINE_EXCEEDED); it never runs."""


class Stopped(Exception):
    """The engine has stopped (the decoder is shutting down): nothing more is queued (UNAVAILABLE)."""


class TokenizerMismatch(ValueError):
    """A trie compiled for another tokenizer: refused, never served."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_seqs: int = 64             # sequences decoding at once (slots)
    max_waiting: int = 256         # bounded queue; past it submit raises QueueFull
    chunk_size: int = 1024         # most prompt tokens of one sequence in one step
    max_step_tokens: int = 2048    # most rows in one step
    max_intent_chars: int = 4000
    head: str = "sparse"           # "sparse": logits of legal candidates only; "dense": all, then mask
    step_ahead: bool = True        # enqueue the next step before reading the picks, where it can be (below)
    finish_forced: bool = True     # end an answer once its last name is the only one left below its node
    forced_runs: bool = True       # feed the tokens a request's shortlist forces in one step, not a step each
    shortlist: int = SHORTLIST     # tools retrieved into a request's prompt (the answer is k of them)
    max_shortlist: int = 256       # the most a request may ask for
    fusion_weight: float = 0.0     # logits a retrieval rank is worth when the sampler picks (docs/quality.md)
    fusion_weight_unseen: float | None = None   # the same for a catalog the selector was not tuned on (None: same)
    admission: bool = True         # refuse a request that would finish after its deadline (expected_seconds)
    line_kv: bool = False          # compute each tool line's K/V once and copy it into requests (engine/lines.py)
    warm_rows: int = 512           # with line_kv, rows a step gives a new version's lines while no request waits
                                   # (0: lines computed only for the requests that list them)


@dataclasses.dataclass
class Launched:
    """A step enqueued on the device whose picks the host has not read yet."""
    batch: StepBatch
    sampling: list[Sequence]   # the rows that get a token, in logit-row order
    picks: object              # the sampler's handle for them (sampler.finish reads it)
    warmups: list[Sequence]    # catalog warm-ups whose prefix this step completes


class DecodeEngine:
    def __init__(self, backend, tokenizer, num_blocks: int, block_size: int, max_positions: int,
                 config: EngineConfig = EngineConfig(), tuned_tools: frozenset[str] = frozenset()):
        # A backend with fixed step buffers (the GPU one) bounds the rows and logit rows of a step.
        max_rows = getattr(backend, "max_rows", config.max_step_tokens)
        max_seqs = min(config.max_seqs, getattr(backend, "max_logit_rows", config.max_seqs))
        config = dataclasses.replace(config, max_step_tokens=min(config.max_step_tokens, max_rows),
                                     chunk_size=min(config.chunk_size, max_rows), max_seqs=max_seqs)
        self.backend, self.tok, self.config = backend, tokenizer, config
        self.tuned_tools = tuned_tools    # the tools the selector was tuned on (fusion.catalog_weight)
        self.block_size, self.max_positions = block_size, max_positions
        self.blocks = BlockManager(num_blocks)
        self.lines = Lines(self.blocks, block_size) if config.line_kv else None
        self.scheduler = Scheduler(self.blocks, block_size, config.max_seqs, config.chunk_size,
                                   config.max_step_tokens, self.lines, getattr(backend, "max_table", None))
        self._inbox: deque = deque()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._running = False
        self._stopped = False
        self._live: set[Sequence] = set()   # requests submitted and not finished (under _wake): stop() ends them
        self.sampler = make_sampler(backend, config.head, config.finish_forced)
        self._ahead: Launched | None = None  # a step launched before the one before it was read
        self._warming: deque = deque()        # line_kv's warm-up: (version, its line keys not started, when)
        self.steps_ahead = 0                  # how many steps were launched ahead (metrics, tests)
        self.steps_dropped = 0                # of those, how many were dropped unread (every row had ended)
        self.tokens_forced = 0                # answer tokens taken without a step of their own (forced)
        self.service_seconds = 0.0            # recent requests' time from admission to answer (a moving average)
        self.on_step = None  # optional callable(seconds) for each step that did work (metrics)

    # --- catalogs ------------------------------------------------------------------------------
    def load_catalog(self, trie: Trie, retriever: Retriever | None = None) -> CatalogRuntime:
        """Check a trie against this engine's tokenizer and queue the warm-up of its prefix (without a
        retriever, the version retrieves by BM25 alone).

        The returned runtime's `ready` event is set once its prefix KV is computed."""
        if trie.meta.get("tokenizer_hash") != self.tok.hash:
            raise TokenizerMismatch(f"catalog {trie.meta.get('name')!r} v{trie.meta.get('version')} was compiled "
                                    f"for tokenizer {str(trie.meta.get('tokenizer_hash'))[:12]}, this decoder "
                                    f"uses {self.tok.hash[:12]}")
        if retriever is None:
            retriever = Retriever(bm25_index(trie), len(trie.pointer_names))
        rt = CatalogRuntime.from_trie(trie, retriever, self.tok, self.block_size)
        rt.fusion_weight = catalog_weight(trie.pointer_names, self.tuned_tools, self.config.fusion_weight,
                                          self.config.fusion_weight_unseen)
        if len(rt.prefix_ids) >= self.max_positions:
            raise RequestError(f"catalog prefix of {len(rt.prefix_ids)} tokens does not fit the model's "
                               f"{self.max_positions} positions")
        if not rt.prefix_ids:
            rt.ready.set()
            return rt
        warm = Sequence(request_id=f"warmup:{rt.key[0]}:v{rt.key[1]}", catalog=rt,
                        prompt_ids=rt.prefix_ids, k=0, allow=np.empty(0, np.int32), allow_all=True, warmup=True)
        self._post(("submit", warm))
        return rt

    def make_resident(self, rt: CatalogRuntime, constant: bool = True) -> None:
        """Place the version's trie where the sampler reads it (on a GPU: upload and bind; `constant`: also in
        constant memory, for the default), at the engine's next step, before any request queued after this
        call: at the version switch, so that no decode step of its requests pays for it."""
        self._post(("bind_catalog", (rt, constant)))

    def release_catalog(self, rt: CatalogRuntime) -> None:
        """Drop the version's own hold on its prefix blocks; the shared ones are freed when its last request
        ends (a request holds no reference to the tail block: it copied the tail's K/V when admitted)."""
        self._post(("release_catalog", rt))

    # --- requests ------------------------------------------------------------------------------
    def retrieve(self, catalog: CatalogRuntime, intent: str, k: int, allow: list[str] | None = None,
                 size: int = 0, prompt: bool = True) -> Shortlist:
        """Validate a request and retrieve its shortlist: the `size` (0: the engine's setting, at least k)
        best tools for the intent among those the allowlist names (all when it is empty). prompt: whether a
        generator's prompt follows, whose intent tokens are then taken while the device scores."""
        n_tools = len(catalog.trie.pointer_names)
        if not isinstance(k, int) or k < 1:
            raise RequestError(f"k must be at least 1, got {k}")
        if not intent or not intent.strip():
            raise RequestError("the intent is empty")
        if len(intent) > self.config.max_intent_chars:
            raise RequestError(f"the intent has {len(intent)} characters, over the limit of "
                               f"{self.config.max_intent_chars}")
        if size < 0 or size > self.config.max_shortlist:
            raise RequestError(f"the shortlist size must be 0 (the default) to {self.config.max_shortlist}, got {size}")
        allowed = None
        if allow:
            try:
                allowed = catalog.pointer_ids(list(allow))
            except KeyError as e:
                raise RequestError(f"allowlist: no tool named {e.args[0]!r:.200} in catalog "
                                   f"{catalog.key[0]!r} v{catalog.key[1]}") from None
            if k > len(allowed):
                raise RequestError(f"k={k} is larger than the allowlist's {len(allowed)} tools")
        elif k > n_tools:
            raise RequestError(f"k={k} is larger than the catalog's {n_tools} tools")
        return catalog.retriever.shortlist(intent, max(size or self.config.shortlist, k), allowed,
                                           catalog.tokenizer.encode_plain if prompt else None)

    def submit(self, catalog: CatalogRuntime, intent: str, k: int, allow: list[str] | None = None,
               request_id: str | None = None, timeout: float | None = None,
               shortlist: Shortlist | None = None, on_finish=None) -> Sequence:
        """Queue a request (retrieving its shortlist first unless given one from `retrieve`); iterate the
        returned Sequence for its events. The prompt lists the shortlist in retrieval order and the answer is
        k of its tools; a timeout of 0 or less has already expired (the request never runs). on_finish is
        called once the engine has let go of the request (its KV blocks released), e.g. to unpin its catalog."""
        if shortlist is None:
            shortlist = self.retrieve(catalog, intent, k, allow)
        if timeout is not None and timeout <= 0:
            raise Expired("the request's deadline passed before it was queued")
        prompt = catalog.prefix_ids + catalog.request_ids(shortlist.ids, intent, k, shortlist.intent_ids)
        order = np.argsort(shortlist.ids, kind="stable")   # the allowlist is sorted; rank order[j] is allow[j]'s
        keys, rows = catalog.line_keys(shortlist.ids, k) if self.lines else ([], 0)
        seq = Sequence(request_id=request_id or uuid.uuid4().hex, catalog=catalog, prompt_ids=prompt, k=k,
                       allow=np.ascontiguousarray(shortlist.ids[order], np.int32), allow_all=False,
                       prior=rank_prior(order, catalog.fusion_weight),
                       deadline=time.monotonic() + timeout if timeout is not None else None, on_finish=on_finish,
                       line_keys=keys, line_rows=rows)
        if seq.max_positions() > self.max_positions:
            raise RequestError(f"prompt ({len(prompt)} tokens) plus the worst-case answer for k={k} "
                               f"exceeds the model's {self.max_positions} positions")
        jobs = sum(self.lines.blocks_for(catalog.tail_tokens, key) for key in keys) if keys else 0
        if -(-seq.max_positions() // self.block_size) + jobs > self.blocks.num_blocks:
            raise RequestError(f"the request needs more KV blocks than the pool holds ({self.blocks.num_blocks})")
        with self._wake:
            if self._stopped:
                raise Stopped("the decoder is shutting down")
            waiting = self.queue_depth()
            if waiting >= self.config.max_waiting:
                raise QueueFull(f"{waiting} requests are already waiting (the bound is {self.config.max_waiting})")
            expected = self.expected_seconds(waiting + len(self.scheduler.running))
            if timeout is not None and expected > timeout:
                raise QueueFull(f"the decoder is busy: a request queued now would finish in about {expected:.1f} s, "
                                f"after its deadline ({timeout:.1f} s)")
            self._inbox.append(("submit", seq))
            self._live.add(seq)
            self._wake.notify()
        return seq

    def expected_seconds(self, ahead: int) -> float:
        """About how long a request with `ahead` requests before it (running or waiting) takes to finish, from the
        recent service time (admission to answer): 0 while a slot is free for it, else that time for each round
        of max_seqs ahead of it and its own. Admission refuses what would finish after its deadline, at once,
        instead of running it for nothing and slowing everyone else."""
        if ahead < self.config.max_seqs or not self.config.admission:
            return 0.0
        return SERVICE_MARGIN * self.service_seconds * (ahead // self.config.max_seqs + 1)

    def queue_depth(self) -> int:
        """Requests submitted and not yet admitted (catalog warm-ups do not count)."""
        pending = sum(1 for kind, item in self._inbox if kind == "submit" and not item.warmup)
        return pending + sum(1 for s in self.scheduler.waiting if not s.warmup)

    def cancel(self, seq: Sequence) -> None:
        """Fail the request and free its KV blocks at the next step."""
        seq.cancelled = True
        self._post(("wake", None))

    # --- the loop ------------------------------------------------------------------------------
    def _post(self, item) -> None:
        with self._wake:
            self._inbox.append(item)
            self._wake.notify()

    def _drain_inbox(self) -> list:
        """Take what other threads posted; the versions to bind, which the step binds once the lock is let go
        (an upload must not hold up submit) and before it admits or plans anything."""
        binds = []
        while self._inbox:
            kind, item = self._inbox.popleft()
            if kind == "submit":
                self.scheduler.add(item)
            elif kind == "bind_catalog":
                binds.append(item)
            elif kind == "release_catalog":
                self.blocks.release(item.held_blocks())
                self.sampler.forget(item)
                self._warming = deque(w for w in self._warming if w[0] is not item)
        return binds

    def has_work(self) -> bool:
        return bool(self._inbox or self._ahead or self.scheduler.running or
                    any(s.warmup or s.catalog.ready.is_set() for s in self.scheduler.waiting))

    def step(self) -> bool:
        """One scheduling step: launch the planned rows (or take the step already launched ahead),
        launch the next step of the same rows ahead where nothing else waits for the device, then
        read this step's picks and advance. A step launched ahead of rows that have all ended since is
        dropped unread: the host plans and enqueues the next request while the device still runs it
        (stream order puts it first; the staging ring waits for its copies). Returns False when there
        was nothing to do."""
        with self._wake:
            binds = self._drain_inbox()
        for rt, constant in binds:
            self.sampler.bind(rt, constant)
        now = time.monotonic()
        self._expire(now)
        for seq in self.scheduler.admit(now):
            self._copy_prefix_tail(seq)
        if self.lines:
            self._place_lines([seq for seq in self.scheduler.running
                               if seq.lines and all(line.ready for line in seq.lines)])
        if self._warming:
            self._warm_lines(now)
        launched, self._ahead = self._ahead, None
        if launched is not None and all(seq.state == State.FINISHED for seq in launched.sampling):
            launched = None      # its rows all ended at the read before: its picks are never needed
            self.steps_dropped += 1
        if launched is None:
            if self.config.forced_runs:
                self._take_forced_runs()
            chunks = self.scheduler.plan()
            if not chunks:
                return False
            launched = self._launch(chunks)
        if self._can_step_ahead(launched):
            self._ahead = self._launch_ahead(launched)
            self.steps_ahead += 1
        self._read(launched)
        return True

    def _launch(self, chunks) -> Launched:
        """Enqueue the forward pass of the planned chunks and the sampler for the rows that get a token
        (decode rows, and prompts whose last chunk this is)."""
        batch = self._batch(chunks)
        sampling, rows, warmups = [], [], []
        for i, (seq, toks, _) in enumerate(chunks):
            if seq.state == State.PREFILL:
                seq.computed += len(toks)
                if seq.computed < len(seq.prompt_ids):
                    continue
                if seq.warmup or seq.line:
                    warmups.append(seq)
                    continue
            else:
                seq.fed += len(toks)
                if seq.fed < len(seq.generated):
                    continue
            sampling.append(seq)
            rows.append(i)
        batch = dataclasses.replace(batch, logit_rows=np.ascontiguousarray(batch.logit_rows[rows], np.int32))
        self.backend.forward(batch)
        return Launched(batch, sampling, self.sampler.start(sampling) if sampling else [], warmups)

    def _can_step_ahead(self, launched: Launched) -> bool:
        """May the next step of `launched`'s rows be enqueued before its picks are read? Only where the
        picks are on the device, the step holds every running sequence (none is left mid-prompt, no
        request could be admitted instead), every row is still live, and some row cannot stop at this
        step (a step behind rows that all end is device time the next request waits for). A row whose pick
        enters a forced last name (finish_forced) ends too; refusing for those cost more than the step
        it saves (P58, P60). Nor where a row's next token is forced (its last pick read left one candidate,
        as inside a name its shortlist leaves alone): the step after is planned, so that it feeds the row's
        whole forced run (forced_runs) instead of one token."""
        return (self.config.step_ahead and self.sampler.next_tokens(launched.picks) is not None and not self._inbox
                and not (self.scheduler.waiting and self.scheduler.free_slots)
                and len(launched.sampling) == len(self.scheduler.running)
                and all(seq.state != State.FINISHED for seq in launched.sampling)
                and not all(seq.may_stop() for seq in launched.sampling)
                and not (self.config.forced_runs and any(self._forced_edge(seq) >= 0 for seq in launched.sampling)))

    def _launch_ahead(self, launched: Launched) -> Launched:
        """The next step of `launched`'s rows, enqueued before its picks are read: one decode row each at
        the next position with the block tables it had, its token copied on the device from the sampler's
        output, the sampler continuing from the trie state it left on the device. Every row's inputs
        are those the step planned after reading the picks would have (rows in another order, which no
        row's result depends on). A row that ends meanwhile has its pick dropped when read; its K/V write
        lands in blocks whose next owner's steps are enqueued after this one, on the same stream. Its forward
        pass runs only if some row's answer did not end at those picks (the sampler's done flags): where
        all did, the step is dropped unread (step()) and would only delay the next request."""
        prev, n = launched.batch, len(launched.sampling)
        rows = np.arange(n, dtype=np.int32)
        batch = StepBatch(tokens=np.zeros(n, np.int32), slots=rows,
                          positions=np.ascontiguousarray(prev.positions[prev.logit_rows] + 1, np.int32),
                          block_tables=prev.block_tables, logit_rows=rows, decode_rows=n)
        self.backend.forward(batch, device_tokens=self.sampler.next_tokens(launched.picks),
                             skip_if_done=self.sampler.done_flags(launched.picks))
        for seq in launched.sampling:
            seq.fed += 1   # the pick the host has not read yet
        return Launched(batch, launched.sampling, self.sampler.follow(launched.picks), [])

    def _read(self, launched: Launched) -> None:
        """Wait for a step's picks and advance its rows (a row that ended while it ran is skipped), then
        complete the catalog warm-ups it finished."""
        for seq, pick in zip(launched.sampling, self.sampler.finish(launched.picks)):
            if seq.state == State.FINISHED:
                continue
            if isinstance(pick, str):
                self._fail(seq, FailedEvent("internal", pick))
            else:
                self._advance(seq, pick)
        for seq in launched.warmups:
            if seq.line:
                self._finish_line(seq)
            else:
                self._finish_warmup(seq)

    def _batch(self, chunks) -> StepBatch:
        """The step's rows, with block tables for just the sequences in it (table row i: chunk i's):
        the catalog's shared prefix blocks (an array: copied by one slice) then the sequence's own."""
        parts = [(self.scheduler.prefix_blocks(seq), seq.blocks) for seq, _, _ in chunks]
        tables = np.full((len(parts), max(len(p) + len(own) for p, own in parts)), -1, np.int32)
        for i, (prefix, own) in enumerate(parts):
            tables[i, :len(prefix)] = prefix
            tables[i, len(prefix):len(prefix) + len(own)] = own
        decodes = sum(len(toks) for seq, toks, _ in chunks if seq.state == State.DECODE)   # planned first
        return StepBatch.from_chunks([(i, toks, start) for i, (_, toks, start) in enumerate(chunks)], tables,
                                     decodes)

    def _copy_prefix_tail(self, seq: Sequence) -> None:
        """A request admitted on a catalog starts after its prefix: the whole blocks are shared, and the
        tail's K/V is copied (in stream order, before its prefill) into the request's first own block."""
        rt = seq.catalog
        if not seq.warmup and rt.tail_tokens:
            self.backend.copy_kv(rt.tail_block, seq.blocks[0], rt.tail_tokens)
            seq.computed += rt.tail_tokens

    def _place_lines(self, seqs: list[Sequence]) -> None:
        """Copy the requests' kept lines into their own blocks, each line's keys rotated from its canonical place (right
        after the prefix) to where the prompt lists it: one place_kv for them all, in stream order before their
        prefills go on."""
        if not seqs:
            return
        bs, src, dst, shift = self.block_size, [], [], []
        for seq in seqs:
            rt, blocks = seq.catalog, np.asarray(seq.blocks, np.int32)
            start = at = len(rt.prefix_ids)
            for line in seq.lines:
                n = min(len(line.tokens), start + seq.line_rows - at)
                positions = np.arange(at, at + n) - rt.shared_tokens
                src.append(self.lines.slots(line, rt.tail_tokens, n))
                dst.append(blocks[positions // bs] * bs + positions % bs)
                shift.append(np.full(n, at - start, np.int32))
                at += n
            seq.computed = at
            self.lines.unpin(seq.lines)
            seq.lines = []
        self.backend.place_kv(*(np.ascontiguousarray(np.concatenate(a), np.int32) for a in (src, dst, shift)))

    def _finish_line(self, job: Sequence) -> None:
        """A line job's step was read: its blocks are now the kept line's."""
        job.line.blocks, job.blocks = job.blocks, []
        job.line.ready = True
        self.scheduler.release(job)
        job.state = State.FINISHED

    def _warm_lines(self, now: float) -> None:
        """Start jobs for the lines of the versions warming, at most warm_rows rows a step, while no request waits.
        A version's warm-up ends where the next line would leave under half the pool free (the rest are computed for
        the requests that list them) or once every line is computed; it notes the time it took (lines_ready)."""
        rows, reserve = self.config.warm_rows, self.blocks.num_blocks // 2
        while self._warming and not self.scheduler.waiting:
            rt, keys, started = self._warming[0]
            if not keys:
                if not any(s.line and s.catalog is rt for s in self.scheduler.running):
                    self._warming.popleft()
                    rt.lines_seconds = now - started
                    rt.lines_ready.set()
                    log.info("catalog %s v%s: tool lines computed in %.2f s", *rt.key, rt.lines_seconds)
                    continue
                return
            key = keys[0]
            if key in self.lines.kept:
                keys.popleft()
                continue
            if self.blocks.num_free - self.lines.blocks_for(rt.tail_tokens, key) < reserve:
                keys.clear()
                continue
            if len(key[1]) > rows:
                return
            rows -= len(key[1])
            _, new = self.lines.take([keys.popleft()])
            for job in self.scheduler.line_jobs(rt, new, now):
                self._copy_prefix_tail(job)

    def _finish_warmup(self, seq: Sequence) -> None:
        rt = seq.catalog
        # the version now holds the blocks' reference: its whole blocks to share, then the tail's
        blocks, whole = np.asarray(seq.blocks, np.int32), rt.shared_tokens // self.block_size
        rt.shared_blocks, seq.blocks = blocks[:whole], []
        rt.tail_block = int(blocks[whole]) if rt.tail_tokens else -1
        self.scheduler.release(seq)
        seq.state = State.FINISHED
        rt.warm_seconds = time.monotonic() - seq.t_submit
        rt.ready.set()
        log.info("catalog %s v%s warm: %d prefix tokens in %.2f s", *rt.key, len(rt.prefix_ids), rt.warm_seconds)
        if self.lines and self.config.warm_rows:
            keys = rt.line_keys(range(len(rt.trie.pointer_names)), 1)[0]
            self._warming.append((rt, deque(keys), time.monotonic()))

    def _expire(self, now: float) -> None:
        """Fail cancelled and expired requests, and waiting ones that would finish after their deadline (busy:
        expected_seconds). A caller's RPC ends at the deadline it shares with the request and cancels it then,
        a moment before the engine's clock passes it: within EXPIRY_SLACK of its deadline, a cancelled request
        counts as expired."""
        running, waiting = list(self.scheduler.running), list(self.scheduler.waiting)
        for ahead, seq in enumerate([*running, *waiting]):
            expired = seq.deadline is not None and now > seq.deadline - (EXPIRY_SLACK if seq.cancelled else 0.0)
            if expired:
                self._fail(seq, FailedEvent("deadline", "the request's deadline passed"))
            elif seq.cancelled:
                self._fail(seq, FailedEvent("cancelled", "the request was cancelled"))
            elif seq.state == State.WAITING and seq.deadline is not None and not seq.warmup:
                expected = self.expected_seconds(ahead)
                if now + expected > seq.deadline:
                    self._fail(seq, FailedEvent("busy", f"the decoder is busy: the request would finish in about "
                                                        f"{expected:.1f} s, after its deadline"))

    def _fail(self, seq: Sequence, event: FailedEvent) -> None:
        self.scheduler.release(seq)
        self._finish(seq, event)

    def _finish(self, seq: Sequence, event) -> None:
        """The request's last event, once its blocks are back; it is no longer live."""
        with self._wake:
            self._live.discard(seq)
        seq.finish(event)

    def _advance(self, seq: Sequence, pick: Pick) -> None:
        """Advance on the host's own trie by the sampler's token; a token that is not the chosen edge
        of the current node (a stale or corrupted device trie) fails the request at once."""
        trie = seq.catalog.trie
        edge, token, logprob = pick
        if trie.find_edge(seq.node, token) != edge:
            self._fail(seq, FailedEvent("internal", f"the sampler chose token {token} (edge {edge}), which is not "
                                                    f"that edge of trie node {seq.node}: stale or corrupted trie"))
            return
        child = int(trie.edge_child[edge])
        if seq.state == State.PREFILL:
            seq.state, seq.t_first_decode = State.DECODE, time.monotonic()
        seq.generated.append(token)
        seq.pointer_logprob += logprob
        if child not in (SEP, STOP):
            seq.pointer_tokens.append(token)
            seq.node = child
            if self.config.finish_forced and seq.n_emitted + 1 == seq.k:
                self._take_forced(seq)
            return
        pid = int(trie.edge_lo[edge])
        seq.events.put(PointerEvent(index=seq.n_emitted, pointer_id=pid, name=trie.pointer_names[pid],
                                    token_ids=tuple(seq.pointer_tokens), logprob=seq.pointer_logprob))
        seq.emitted[seq.n_emitted] = pid
        seq.n_emitted += 1
        seq.pointer_tokens, seq.pointer_logprob, seq.node = [], 0.0, 0
        if child == STOP:
            self._complete(seq)

    def _take_forced_runs(self) -> None:
        """Before a step is planned (none is in flight): each decoding request takes the tokens its answer forces
        from its node on (one allowed name left below it, then that name's separator or stop; `forced_edge`),
        so that the step feeds them as decode rows of one step instead of a step each. Each row computes what it
        would alone, and a forced token has log-probability 0 whatever the logits, so every answer is the one
        computed a token a step; a name streams as soon as it is forced."""
        for seq in list(self.scheduler.running):
            while seq.state == State.DECODE:
                edge = self._forced_edge(seq)
                if edge < 0:
                    break
                self.tokens_forced += 1
                self._advance(seq, Pick(edge, int(seq.catalog.trie.edge_token[edge]), 0.0))

    @staticmethod
    def _forced_edge(seq: Sequence) -> int:
        """The one edge the request leaves at the row's node (sampler.forced_edge), or -1."""
        rt, t = seq.catalog, seq.catalog.trie
        return forced_edge(seq.node, *rt.node_span, t.node_edge_start, t.edge_child, t.edge_lo, t.edge_hi, seq.emitted,
                           seq.n_emitted, seq.k, seq.allow, seq.allow_all)

    def _take_forced(self, seq: Sequence) -> None:
        """On the last pointer, at a node with one pointer below, every token to the stop is forced: the
        sampler's only candidate, log-probability 0 whatever the logits. Take them here, so the answer
        completes now instead of after a step per token; its tokens, names and scores are the same."""
        edge = int(seq.catalog.last_pointer_edge[seq.node])
        if edge >= 0:
            self.tokens_forced += 1
            self._advance(seq, Pick(edge, int(seq.catalog.trie.edge_token[edge]), 0.0))

    def _complete(self, seq: Sequence) -> None:
        """Host walk of the whole answer through the trie, then Done (or a loud failure)."""
        try:
            walked = seq.catalog.trie.walk(seq.generated, seq.k)
            if walked != list(seq.emitted[:seq.n_emitted]):
                raise TrieWalkError(f"walk gives {walked}, the device emitted {list(seq.emitted)}")
        except TrieWalkError as e:
            self._fail(seq, FailedEvent("internal", f"host walk of the answer failed: {e}"))
            return
        now = time.monotonic()
        served = now - seq.t_admit
        self.service_seconds = self.service_seconds + SERVICE_SMOOTHING * (served - self.service_seconds) \
            if self.service_seconds else served
        self.scheduler.release(seq)
        self._finish(seq, DoneEvent(prompt_tokens=len(seq.prompt_ids), generated_tokens=len(seq.generated),
                                    queue_ms=(seq.t_admit - seq.t_submit) * 1e3,
                                    prefill_ms=(seq.t_first_decode - seq.t_admit) * 1e3,
                                    decode_ms=(now - seq.t_first_decode) * 1e3))

    # --- threading -----------------------------------------------------------------------------
    def start(self) -> None:
        """Run steps on a background thread (the one that owns the device) until stop()."""
        self._running, self._stopped = True, False
        self._thread = threading.Thread(target=self._loop, name="tooltrie-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """End the loop after its step, then fail every request it still holds (running, waiting or not yet
        taken) with "unavailable", so that no caller waits for a step that will never come; later submits
        raise Stopped. A step still running after `timeout` seconds (a long prefill on the CPU) is left to
        end on its own: its requests' callers are told at once, and the step's results are never read."""
        with self._wake:
            self._running, self._stopped = False, True
            self._wake.notify()
        if self._thread:
            self._thread.join(timeout)
        stopped = FailedEvent("unavailable", "the decoder is shutting down")
        if self._thread and self._thread.is_alive():
            with self._wake:
                live, self._live = self._live, set()
            for seq in live:
                seq.events.put(stopped)   # the engine thread, still in its step, owns the rest of the Sequence
            return
        with self._wake:
            left = [item for kind, item in self._inbox if kind == "submit"]
            self._inbox.clear()
        self._ahead = None
        for seq in [*self.scheduler.running, *self.scheduler.waiting, *left]:
            if seq.state != State.FINISHED:
                self._fail(seq, stopped)

    def _loop(self) -> None:
        while self._running:
            try:
                started = time.perf_counter()
                worked = self.step()
                if worked and self.on_step:
                    self.on_step(time.perf_counter() - started)
            except Exception as e:  # a fault fails the running requests, not the engine
                log.exception("engine step failed")
                self._ahead = None
                for seq in list(self.scheduler.running):
                    self._fail(seq, FailedEvent("internal", f"engine fault: {e}"))
                worked = False
            if not worked:
                with self._wake:
                    if not self.has_work():
                        self._wake.wait(timeout=0.05)

    def run_until_idle(self, max_steps: int = 100_000) -> None:
        """Step on the calling thread until nothing is left (tests and benchmarks)."""
        for _ in range(max_steps):
            if not self.step() and not self.has_work():
                return
        raise RuntimeError(f"engine still busy after {max_steps} steps")

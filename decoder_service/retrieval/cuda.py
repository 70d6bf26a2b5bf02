"""The dense half of retrieval on the GPU: every tool's fused score, and the shortlist, on the device.

A version's tool and request vectors stay on the device (float16, run-major); k_fuse (a thread a tool: its best
cosine with the intent's parts, compiled for each count of parts), the requests' votes (k_fuse's blocks past the
tools score the requests, Best keeps the nearest, k_vote), k_add (BM25) and Best (k_top: warps' bitonic sorts merged
by a tournament of one warp; k_merge: the blocks' lists merged the same way, staged in shared memory) leave only n
ids and scores for the host, in host.top_n's order, the same in any order of requests (P78, P107, P112, P117,
P118). Every kernel is launched with PDL, and BM25's matches come in on a side stream while the intent's encoder
pass runs (P124).
"""
from __future__ import annotations

import ctypes
import functools
import math
import weakref

import numba
import numpy as np

from decoder_service.gpu.intrinsics import WARP, dot8, ld8, ld8_once, ld_l2, pdl_enter, xor_pair
from decoder_service.gpu.launcher import (SIM, Kernel, Launch, Scalar, Stream, destroy_event,  # numpy fix first
                                          new_event)
from decoder_service.encoder.turns import Turns
from numba import cuda
from numba.cuda import types as t

from .config import MAX_PARTS, NEIGHBOURS, VOTE_TEMPERATURE

FUSE_THREADS = 16 if SIM else 128   # k_fuse's block: a thread a row (a tool's or a request's)
MOMENT_LANES = 4 if SIM else 32     # k_moments: threads a row of the tools' second moment
MOMENT_THREADS = 32 if SIM else 256  # k_moments' block (MOMENT_THREADS / MOMENT_LANES rows)
SORT = 64 if SIM else 1024  # k_top's block: a thread an entry of its slice
WARPS = SORT // WARP        # k_top's warps: the sorted lists its first warp merges
MAX_LISTS = 64 if SIM else 4096   # k_merge: most k_top blocks (lists) it merges
STAGED = 64 if SIM else 3072      # k_merge: most entries it stages in shared memory (more: read where they are)
MERGE_THREADS = 16 if SIM else 256   # k_merge's block: all stage the lists, the first warp merges them
MAX_TOOLS = SORT * MAX_LISTS      # most tools (and requests) the device scorer holds
MAX_N = 48 if SIM else 64   # longest shortlist the device path serves (longer: the host's); below SORT
VOTERS = 32                 # k_vote's block: at most this many nearest requests vote
LAST_ID = 2147483647        # the id of Best's padding, after every real entry
if MAX_PARTS != 8 or NEIGHBOURS > VOTERS:
    raise ImportError(f"k_fuse keeps a sum for each of 8 parts and k_vote reads {VOTERS} requests at most; "
                      f"config.MAX_PARTS is {MAX_PARTS}, NEIGHBOURS {NEIGHBOURS}")
_F, _H, _I, _D = (t.Array(dt, 1, "C") for dt in (t.float32, t.float16, t.int32, t.float64))
_S, _X = t.int32, t.float32


def holds(tools: int, voters: int) -> bool:
    """Whether the device scorer takes a version of `tools` tools and `voters` voting requests (k_merge's lists)."""
    return max(tools, voters) <= MAX_TOOLS


@cuda.jit(device=True, inline="always")
def _start(p, parts):
    """Part p's sum before the first run: 0, or -inf where the intent has fewer parts (never the best)."""
    return numba.float32(0.0) if p < parts else numba.float32(-math.inf)


@cuda.jit(device=True, inline="always")
def _part(x, queries, i, s, p, parts):
    """s plus x . queries[i:i + 8] (ascending) for part p, s as it is where the intent has fewer parts."""
    return dot8(x, ld8(queries, i), s) if p < parts else s


@cuda.jit(device=True, inline="always")
def _run(x, queries, j, dim, parts, s):
    """Each part's sum in s plus x . that part's queries[j:j + 8] (x a tool's dimensions j..j + 7)."""
    return (_part(x, queries, j, s[0], 0, parts), _part(x, queries, dim + j, s[1], 1, parts),
            _part(x, queries, 2 * dim + j, s[2], 2, parts), _part(x, queries, 3 * dim + j, s[3], 3, parts),
            _part(x, queries, 4 * dim + j, s[4], 4, parts), _part(x, queries, 5 * dim + j, s[5], 5, parts),
            _part(x, queries, 6 * dim + j, s[6], 6, parts), _part(x, queries, 7 * dim + j, s[7], 7, parts))


@functools.cache
def fuse_kernel(parts: int):
    """k_fuse for intents of `parts` parts: a constant, so that the parts an intent lacks cost neither registers
    nor branches (P117)."""

    @cuda.jit(cache=not SIM)
    def k_fuse(vectors, n, out, requests, m, request_out, dim, queries, coef, shift):
        """out[tool] = a * max over the parts p of (vectors[tool] . queries[p]) + k0, a = coef[0] and k0 =
        coef[1] - shift, each rounded to float32 (coef: k_moments may compute it just before; shift: the BM25
        term's, known later); blocks past the tools' give request_out[e] = the best cosine of request e
        (requests: their vectors, m of them), so that both share one launch. A thread a row; vectors are
        run-major (run_major: a warp's loads of one run of 8 dimensions are 32 rows' consecutive 16 bytes); a
        row's runs are read once for every part, four loads in flight, each part's sum ascending over the
        dimensions."""
        pdl_enter()
        b, tools = cuda.blockIdx.x, -(-n // cuda.blockDim.x)
        if b < tools:
            rows, count, dst, a, k0 = vectors, n, out, numba.float32(coef[0]), numba.float32(coef[1] - shift)
        else:
            b -= tools
            rows, count, dst, a, k0 = requests, m, request_out, numba.float32(1.0), numba.float32(0.0)
        row = b * cuda.blockDim.x + cuda.threadIdx.x
        if row >= count:
            return
        s = (numba.float32(0.0), _start(1, parts), _start(2, parts), _start(3, parts), _start(4, parts),
             _start(5, parts), _start(6, parts), _start(7, parts))
        at, step = row * 8, count * 8
        j = 0
        while j + 32 <= dim:
            x0, x1 = ld8_once(rows, at), ld8_once(rows, at + step)
            x2, x3 = ld8_once(rows, at + 2 * step), ld8_once(rows, at + 3 * step)
            s = _run(x3, queries, j + 24, dim, parts, _run(x2, queries, j + 16, dim, parts, _run(
                x1, queries, j + 8, dim, parts, _run(x0, queries, j, dim, parts, s))))
            at += 4 * step
            j += 32
        while j < dim:
            s = _run(ld8_once(rows, at), queries, j, dim, parts, s)
            at += step
            j += 8
        best = max(max(max(s[0], s[1]), max(s[2], s[3])), max(max(s[4], s[5]), max(s[6], s[7])))
        dst[row] = a * best + k0

    return k_fuse


def run_major(vectors: np.ndarray) -> np.ndarray:
    """float16 [n, dim] (dim a multiple of 8) as k_fuse reads it, flat: run r of tool t (its dimensions
    8r..8r + 7) at (r * n + t) * 8."""
    n, dim = vectors.shape
    return np.ascontiguousarray(np.asarray(vectors, np.float16).reshape(n, dim // 8, 8).transpose(1, 0, 2)).ravel()


@cuda.jit(cache=not SIM)
def k_moments(queries, mean, gram, dim, weight, partial, done, coef):
    """coef = (a, -a m) of the intent's dense term, standardised over every tool and weighted by `weight`: its
    cosines with the tools have mean m = mean.q and variance v = q.gram.q - m^2 (q = queries[:dim]), so a =
    weight / sqrt(v) (0 where v is 0). Block b sums, for its rows i (a warp each, the lanes striding the
    columns), mean[i] q[i] and q[i] (gram q)[i] into partial[2b:2b + 2], in float64 (each lane's columns
    ascending, then the lanes', then the rows', in order); the last block to finish adds the blocks' sums in
    block order and writes coef. Loads go out ahead of their sums (a lane's four columns; the last block's
    partials, by all its threads), the additions in the same order (P121)."""
    pdl_enter()
    tid = cuda.threadIdx.x
    lane, w = tid % MOMENT_LANES, tid // MOMENT_LANES
    rows = cuda.blockDim.x // MOMENT_LANES
    i = cuda.blockIdx.x * rows + w
    red = cuda.shared.array(MOMENT_THREADS, numba.float64)
    last = cuda.shared.array(1, numba.int32)
    g = numba.float64(0.0)
    if i < dim:
        j, L, at = lane, MOMENT_LANES, i * dim
        while j + 3 * L < dim:
            x0, x1, x2, x3 = gram[at + j], gram[at + j + L], gram[at + j + 2 * L], gram[at + j + 3 * L]
            g += x0 * numba.float64(queries[j])
            g += x1 * numba.float64(queries[j + L])
            g += x2 * numba.float64(queries[j + 2 * L])
            g += x3 * numba.float64(queries[j + 3 * L])
            j += 4 * L
        while j < dim:
            g += gram[at + j] * numba.float64(queries[j])
            j += L
    red[tid] = g
    cuda.syncthreads()
    if tid == 0:
        m = q2 = numba.float64(0.0)
        for r in range(rows):
            row = cuda.blockIdx.x * rows + r
            if row < dim:
                gi = numba.float64(0.0)
                for e in range(MOMENT_LANES):
                    gi += red[r * MOMENT_LANES + e]
                qi = numba.float64(queries[row])
                m += mean[row] * qi
                q2 += qi * gi
        partial[2 * cuda.blockIdx.x] = m
        partial[2 * cuda.blockIdx.x + 1] = q2
        cuda.threadfence()
        last[0] = 1 if cuda.atomic.add(done, 0, 1) == cuda.gridDim.x - 1 else 0
    cuda.syncthreads()
    if last[0] == 0:
        return
    for e in range(tid, 2 * cuda.gridDim.x, cuda.blockDim.x):   # the last block: every block's sums are written
        red[e] = ld_l2(partial, e)
    cuda.syncthreads()
    if tid != 0:
        return
    done[0] = 0
    m = q2 = numba.float64(0.0)
    for b in range(cuda.gridDim.x):
        m += red[2 * b]
        q2 += red[2 * b + 1]
    sd = math.sqrt(max(q2 - m * m, 0.0))
    a = weight / sd if sd > 0 else 0.0
    coef[0] = a
    coef[1] = -a * m


@cuda.jit(cache=not SIM)
def k_add(ids, values, m, c, out):
    """out[ids[i]] += c * values[m + i]: the BM25 term of the m tools the query matched (distinct ids; ids and
    values are one buffer, as one copy brings them)."""
    pdl_enter()
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < m:
        out[ids[i]] += c * values[m + i]


@cuda.jit(cache=not SIM)
def k_vote(near_scores, near_ids, owner, count, weight, temperature, out):
    """out[owner[e]] += weight * e's share of the vote, for the `count` nearest requests e (best first): a
    softmax of their cosines, in float64. Thread r reads the r-th nearest; the shares' total is summed in rank
    order, and the first thread of each tool adds its requests' shares in rank order: the arithmetic of one
    thread adding them one by one, without its chain of dependent loads."""
    pdl_enter()
    e = cuda.shared.array(VOTERS, numba.float64)
    tool = cuda.shared.array(VOTERS, numba.int32)
    r = cuda.threadIdx.x
    top = numba.float64(near_scores[0])
    if r < count:
        e[r] = math.exp((numba.float64(near_scores[r]) - top) / temperature)
        tool[r] = owner[near_ids[r]]
    cuda.syncthreads()
    if r >= count:
        return
    total = numba.float64(0.0)
    for x in range(count):
        total += e[x]
    t = tool[r]
    for x in range(r):
        if tool[x] == t:
            return
    v = out[t]
    for x in range(r, count):
        if tool[x] == t:
            v += numba.float32(weight * (e[x] / total))
    out[t] = v


@cuda.jit(device=True, inline="always")
def _better(v, i, bv, bi):
    return v > bv or (v == bv and i < bi)


@cuda.jit(device=True, inline="always")
def _warp_sorted(v, i, lane):
    """This lane's (score, id) after a bitonic sort of the warp's pairs, best first (lane 0 the best)."""
    k = 2
    while k <= WARP:
        j = k >> 1
        while j > 0:
            ov, oi = xor_pair(v, i, j)
            keep_better = ((lane & j) == 0) == ((lane & k) == 0)   # the pair's first, in a run sorted best first
            if _better(ov, oi, v, i) == keep_better:
                v, i = ov, oi
            j >>= 1
        k <<= 1
    return v, i


@cuda.jit(device=True, inline="always")
def _lane_best(sv, si, lists, length, pos, lane):
    """(score, id, list) of the best next entry among this lane's lists (lane, lane + WARP, ...); list -1 where
    they are spent."""
    bv, bi, bl = numba.float32(-math.inf), numba.int32(LAST_ID), -1
    for j in range(lane, lists, WARP):
        p = pos[j]
        if p < length and _better(sv[j * length + p], si[j * length + p], bv, bi):
            bv, bi, bl = sv[j * length + p], si[j * length + p], j
    return bv, bi, bl


@cuda.jit(device=True, inline="always")
def _tournament(sv, si, lists, length, pos, top, lane, out_scores, out_ids, base):
    """out_*[base:base + top] = the best `top` entries of `lists` lists sorted best first (list j at
    s*[j * length:], its next entry pos[j], zero at the start), by one warp: each round the warp's best next
    entry (a butterfly; ids are distinct) is taken and its list moves on. Past the entries, (-inf, LAST_ID)."""
    v, i, l = _lane_best(sv, si, lists, length, pos, lane)
    for r in range(top):
        bv, bi = v, i
        off = WARP // 2
        while off > 0:
            ov, oi = xor_pair(bv, bi, off)
            if _better(ov, oi, bv, bi):
                bv, bi = ov, oi
            off >>= 1
        if lane == 0:
            out_scores[base + r] = bv
            out_ids[base + r] = bi
        if l >= 0 and i == bi:
            pos[l] += 1
            v, i, l = _lane_best(sv, si, lists, length, pos, lane)


@cuda.jit(cache=not SIM, **({} if SIM else {"max_registers": 65536 // SORT}))   # a block of SORT threads fits an SM
def k_top(scores, n, top, out_scores, out_ids):
    """Block b: the best `top` of scores[b * SORT:(b + 1) * SORT] (ids their indices), best first, into
    out_*[b * top:]. Each warp sorts its entries in registers, then the first warp merges the warps' lists."""
    pdl_enter()
    sv = cuda.shared.array(SORT, numba.float32)
    si = cuda.shared.array(SORT, numba.int32)
    pos = cuda.shared.array(WARPS, numba.int32)
    tid = cuda.threadIdx.x
    q = cuda.blockIdx.x * SORT + tid
    v, i = numba.float32(-math.inf), numba.int32(LAST_ID)
    if q < n:
        v, i = scores[q], numba.int32(q)
    v, i = _warp_sorted(v, i, tid % WARP)
    sv[tid], si[tid] = v, i
    if tid < WARPS:
        pos[tid] = 0
    cuda.syncthreads()
    if tid < WARP:
        _tournament(sv, si, WARPS, WARP, pos, top, tid, out_scores, out_ids, cuda.blockIdx.x * top)


@cuda.jit(cache=not SIM)
def k_merge(scores, ids, lists, top, out_scores, out_ids):
    """The best `top` of k_top's `lists` lists of `top` entries each, best first, into out_*[:top]: one warp's
    tournament, over the lists staged in shared memory by the whole block where they fit (STAGED entries), so that
    a round's new head is a shared load, not a global one."""
    pdl_enter()
    pos = cuda.shared.array(MAX_LISTS, numba.int32)
    sv = cuda.shared.array(STAGED, numba.float32)
    si = cuda.shared.array(STAGED, numba.int32)
    tid = cuda.threadIdx.x
    staged = lists * top <= STAGED
    if staged:
        for e in range(tid, lists * top, cuda.blockDim.x):
            sv[e], si[e] = scores[e], ids[e]
    for j in range(tid, lists, cuda.blockDim.x):
        pos[j] = 0
    cuda.syncthreads()
    if tid >= WARP:
        return
    if staged:
        _tournament(sv, si, lists, top, pos, top, tid, out_scores, out_ids, 0)
    else:
        _tournament(scores, ids, lists, top, pos, top, tid, out_scores, out_ids, 0)


class DeviceScorer:
    """One version's tool vectors (and its requests', which vote) on the device, and the buffers of its
    shortlist (one request at a time). Built with the CUDA encoder, it shares the encoder's stream and turns, so
    that `retrieve` runs the intent's encoder pass and the shortlist back to back on the device."""

    def __init__(self, vectors: np.ndarray, voters: tuple[np.ndarray, np.ndarray] | None = None, encoder=None):
        n, dim = vectors.shape
        if dim % 8 or dim > MOMENT_THREADS ** 2 // MOMENT_LANES // 2:
            raise ValueError(f"k_fuse reads vectors in runs of 8, k_moments' last block a partial a thread: not a "
                             f"dimension of {dim}")
        if not holds(n, len(voters[1]) if voters is not None else 0):
            raise ValueError(f"the device scorer holds at most {MAX_TOOLS} tools and requests")
        self.n, self.dim, self.encoder = n, dim, encoder
        self.stream = encoder.stream if encoder is not None else Stream()
        self.turns = encoder.turns if encoder is not None else Turns()
        self.side, self.copied = Stream(), new_event()   # BM25's matches come in beside the encoder's pass
        weakref.finalize(self, destroy_event, self.copied)
        self.vectors = cuda.to_device(run_major(vectors))
        tools = np.asarray(vectors, np.float64)
        gram = tools.T @ tools / n
        self.mean = cuda.to_device(tools.mean(axis=0))                 # the cosines' moments for any intent q:
        self.gram = cuda.to_device(((gram + gram.T) / 2).ravel())      # mean @ q and q @ gram @ q
        self.moment_blocks = -(-dim // (MOMENT_THREADS // MOMENT_LANES))
        self.partial = cuda.device_array(2 * self.moment_blocks, np.float64)
        # the intent's vectors: where the encoder's pass leaves them, or copied in by `shortlist`
        self.queries = encoder.emb if encoder is not None else cuda.device_array(MAX_PARTS * dim, np.float32)
        self.coef = cuda.device_array(2, np.float64)
        self.done = cuda.to_device(np.zeros(1, np.int32))      # k_moments' blocks that have written their sums
        self.scores = cuda.device_array(n, np.float32)
        self.matched = cuda.device_array(2 * n, np.int32)    # BM25's m matched ids, then their values' bits
        pin = np.zeros if SIM else cuda.pinned_array
        self.host_queries, self.host_coef = pin(MAX_PARTS * dim, np.float32), pin(2, np.float64)
        self.host_matched = pin(2 * n, np.int32)
        self.host_values = self.host_matched.view(np.float32)     # the matches' values, after their m ids
        # the launches, packed once; what changes per request is in these scalars
        self.c, self.weight = Scalar(ctypes.c_float), Scalar(ctypes.c_float)
        self.dense, self.shift = Scalar(ctypes.c_double), Scalar(ctypes.c_double)
        self.m, self.top = Scalar(ctypes.c_int32), Scalar(ctypes.c_int32)
        self.parts = 1
        k, h = Kernels.get(), self.stream.handle
        self.moments = Launch(k.moments, MOMENT_THREADS, 0, dict(queries=self.queries, mean=self.mean, gram=self.gram,
                                                                  dim=dim, weight=self.dense, partial=self.partial,
                                                                  done=self.done, coef=self.coef), h)
        self.add = Launch(k.add, 256, 0, dict(ids=self.matched, values=self.matched.view(np.float32), m=self.m,
                                              c=self.c, out=self.scores), h)
        self.best = Best(self.scores, n, self.top, MAX_N, self.stream)
        self.vote = None
        self.requests, self.request_scores = cuda.device_array(0, np.float16), cuda.device_array(0, np.float32)
        if voters is not None and len(voters[1]):
            requests, owner = voters
            count = min(NEIGHBOURS, len(owner))
            self.requests = cuda.to_device(run_major(requests))
            self.request_scores = cuda.device_array(len(owner), np.float32)
            self.owner = cuda.to_device(np.ascontiguousarray(owner, np.int32))
            self.nearest = Best(self.request_scores, len(owner), Scalar(ctypes.c_int32, count), count, self.stream)
            self.vote = Launch(k.vote, VOTERS, 0, dict(
                near_scores=self.nearest.scores, near_ids=self.nearest.ids, owner=self.owner, count=count,
                weight=self.weight, temperature=VOTE_TEMPERATURE, out=self.scores), h)
        self.fuse = [Launch(f, FUSE_THREADS, 0, dict(vectors=self.vectors, n=n, out=self.scores,
                                                     requests=self.requests, m=len(self.request_scores),
                                                     request_out=self.request_scores, dim=dim, queries=self.queries,
                                                     coef=self.coef, shift=self.shift), h)
                     for f in k.fuse]     # by the intent's parts
        self.request_blocks = -(-len(self.request_scores) // FUSE_THREADS)

    def shortlist(self, queries: np.ndarray, a: float, k0: float, matched: tuple[np.ndarray, np.ndarray], c: float,
                  top: int, vote_weight: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """(ids, scores) of the `top` best tools by a * (best cosine over the rows of queries) + k0 + c*bm25
        (matched = the BM25 index's (ids, values) of the tools with a nonzero score) + vote_weight * the
        requests' votes (host.Retriever.votes), best first."""
        self._check(top, len(queries))
        with self.turns:
            self.host_queries[:queries.size] = queries.ravel()
            self.host_coef[:] = a, k0
            self.stream.h2d(self.queries, self.host_queries, queries.size)
            self.stream.h2d(self.coef, self.host_coef, 2)
            self.shift.value = 0.0
            self.parts = len(queries)
            self._enqueue(matched, c, top, vote_weight)
            return self._result(top)

    def retrieve(self, seqs: list[np.ndarray], dense: float, lexical, top: int, vote_weight: float,
                 beside=None) -> tuple[np.ndarray, np.ndarray, object]:
        """shortlist's (ids, scores) for the intent's parts (seqs: their token ids), their vectors encoded on the
        device and never copied out: the dense term standardised over every tool (k_moments) and weighted by
        `dense`. lexical() -> (ids, values, c, shift): BM25's matched tools and c * bm25 - shift, its
        standardised, weighted term, computed on the host while the device encodes; beside(): more host work, run
        once the rest is enqueued, while the device scores (its result third, None without it)."""
        if self.encoder is None:
            raise ValueError("retrieve encodes on the device: build the scorer with the CUDA encoder")
        self._check(top, len(seqs))
        with self.turns:
            self.encoder.enqueue(seqs)
            self.parts = len(seqs)
            self.dense.value = dense
            self.moments.launch(self.moment_blocks)
            ids, values, c, shift = lexical()
            self.shift.value = shift
            self._enqueue((ids, values), c, top, vote_weight)
            aside = beside() if beside is not None else None
            return (*self._result(top), aside)

    def _check(self, top: int, parts: int) -> None:
        if top > MAX_N or top > self.n:
            raise ValueError(f"the device shortlist holds 1 to {min(MAX_N, self.n)} tools, asked for {top}")
        if not 1 <= parts <= MAX_PARTS:
            raise ValueError(f"the device scorer takes 1 to {MAX_PARTS} query vectors, got {parts}")

    def _enqueue(self, matched: tuple[np.ndarray, np.ndarray], c: float, top: int, vote_weight: float) -> None:
        """Enqueue the shortlist and its copy back behind the queries and coef (in this caller's turn)."""
        ids, values = matched
        s, m = self.stream, len(ids)
        self.host_matched[:m], self.host_values[m:2 * m] = ids, values
        self.c.value, self.weight.value = c, vote_weight
        self.m.value, self.top.value = m, top
        self.side.h2d(self.matched, self.host_matched, 2 * m)
        self.side.record(self.copied)
        for name, launch in self.launches():
            if name == "k_add":
                s.wait(self.copied)     # BM25's matches, copied on the side stream
            launch()
        self.best.fetch(top)

    def launches(self) -> list[tuple[str, object]]:
        """The shortlist's launches after k_moments as (name, enqueue) pairs in stream order, for the request staged
        last (its parts, its vote weight and its m BM25 matches; the bench times each)."""
        voting, m = self.vote is not None and self.weight.value != 0.0, self.m.value
        fuse, grid = self.fuse[self.parts - 1], -(-self.n // FUSE_THREADS) + (self.request_blocks if voting else 0)
        out = [("k_fuse", lambda: fuse.launch(grid))]
        if voting:
            out += self.nearest.launches("nearest requests") + [("k_vote", lambda: self.vote.launch(1))]
        if m:
            out.append(("k_add", lambda: self.add.launch(-(-m // 256))))
        return out + self.best.launches("shortlist")

    def _result(self, top: int) -> tuple[np.ndarray, np.ndarray]:
        """Wait for the enqueued shortlist (in the same turn) and return its (ids, scores)."""
        self.stream.synchronize()
        return self.best.host_ids[:top].copy(), self.best.host_scores[:top].copy()


class Best:
    """The launches that leave the best `top` (at most `most`) of scores[:n] in `out`: their ids in out[:most] and
    their scores' bits in out[most:] (`ids` and `scores`, views), so that one copy (`fetch`) takes both back;
    k_top's best of each slice of SORT, then (over more than one slice) k_merge's best of those."""

    def __init__(self, scores, n: int, top: Scalar, most: int, stream: Stream):
        if most >= SORT:
            raise ValueError(f"k_top keeps fewer than {SORT} entries, asked for {most}")
        self.lists, self.most, self.stream = -(-n // SORT), most, stream
        self.out = cuda.device_array(2 * most, np.int32)
        self.ids, self.scores = self.out[:most], self.out.view(np.float32)[most:]
        self.host = np.zeros(2 * most, np.int32) if SIM else cuda.pinned_array(2 * most, np.int32)
        self.host_ids, self.host_scores = self.host[:most], self.host.view(np.float32)[most:]
        part_scores, part_ids = self.scores, self.ids     # one slice: its best are the best
        if self.lists > 1:
            part_scores = cuda.device_array(self.lists * most, np.float32)
            part_ids = cuda.device_array(self.lists * most, np.int32)
        k = Kernels.get()
        self.part = Launch(k.top, SORT, 0, dict(scores=scores, n=n, top=top, out_scores=part_scores,
                                                out_ids=part_ids), stream.handle)
        self.merge = Launch(k.merge, MERGE_THREADS, 0, dict(scores=part_scores, ids=part_ids, lists=self.lists,
                                                            top=top, out_scores=self.scores, out_ids=self.ids),
                            stream.handle)

    def launches(self, what: str) -> list[tuple[str, object]]:
        """k_top, then k_merge where there is more than one slice, as (name, enqueue) pairs (`what`: whose best)."""
        out = [(f"k_top ({what})", lambda: self.part.launch(self.lists))]
        return out + ([(f"k_merge ({what})", lambda: self.merge.launch(1))] if self.lists > 1 else [])

    def fetch(self, top: int) -> None:
        """Enqueue the copy of the best `top` ids and scores into host_ids and host_scores (valid after a
        synchronize)."""
        self.stream.d2h(self.host, self.out, self.most + top)


class Kernels:
    """The kernels, compiled once per process."""

    _instance = None

    def __init__(self):
        pdl = functools.partial(Kernel, pdl=True)   # each waits for the one before it, whose run covers its launch
        fuse = (_H, _S, _F, _H, _S, _F, _S, _F, _D, t.float64)
        self.fuse = [pdl(f"k_fuse{p}", dispatcher=fuse_kernel(p), argtypes=fuse)
                     for p in range(1, MAX_PARTS + 1)]      # by the intent's parts
        self.moments = pdl("k_moments", dispatcher=k_moments, argtypes=(_F, _D, _D, _S, t.float64, _D, _I, _D))
        self.add = pdl("k_add", dispatcher=k_add, argtypes=(_I, _F, _S, _X, _F))
        self.top = pdl("k_top", dispatcher=k_top, argtypes=(_F, _S, _S, _F, _I))
        self.merge = pdl("k_merge", dispatcher=k_merge, argtypes=(_F, _I, _S, _S, _F, _I))
        self.vote = pdl("k_vote", dispatcher=k_vote, argtypes=(_F, _I, _I, _S, _X, t.float64, _F))

    @classmethod
    def get(cls) -> "Kernels":
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

"""The dense half of retrieval on the GPU: every tool's fused score, and the shortlist, on the device.

A version's tool and request vectors stay on the device (float16, run-major); k_fuse (a thread a tool: its best
cosine with the intent's parts), the requests' votes (k_fuse over the requests, a two-level k_best for the nearest,
k_vote), k_add (BM25) and a two-level k_best (bitonic sorts in shared memory) leave only n ids and scores for the
host, in retrieval.top_n's order, the same in any order of requests (P78, P107, P112).
"""
from __future__ import annotations

import math

import numba
import numpy as np

import ctypes

from decoder_service.model.cuda.intrinsics import dot8, ld8
from decoder_service.model.cuda.launcher import SIM, Kernel, Launch, Scalar, Stream  # numpy fix first
from decoder_service.encoder.turns import Turns
from decoder_service.retrieval import MAX_PARTS, NEIGHBOURS, VOTE_TEMPERATURE
from numba import cuda  # noqa: E402
from numba.cuda import types as t  # noqa: E402

FUSE_THREADS = 16 if SIM else 128   # k_fuse's block: a thread a tool
MOMENT_LANES = 4 if SIM else 32     # k_moments: threads a row of the tools' second moment
MOMENT_THREADS = 16 if SIM else 256  # k_moments' block (MOMENT_THREADS / MOMENT_LANES rows)
SORT = 64 if SIM else 1024  # entries a k_best block sorts at once (and its first level's slice)
THREADS = SORT // 2         # k_best's block: a thread a pair
MAX_N = 48 if SIM else 64   # longest shortlist the device path serves (longer: the host's); below SORT
LAST_ID = 2147483647        # the id of k_best's padding, after every real entry
if MAX_PARTS != 8:
    raise ImportError(f"k_fuse keeps a sum for each of 8 parts, retrieval.MAX_PARTS is {MAX_PARTS}")
_F, _H, _I, _D = (t.Array(dt, 1, "C") for dt in (t.float32, t.float16, t.int32, t.float64))
_S, _X = t.int32, t.float32


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


@cuda.jit(cache=not SIM)
def k_fuse(vectors, dim, n, queries, parts, coef, out):
    """out[tool] = a * max over the parts p of (vectors[tool] . queries[p]) + k0, (a, k0) = coef (on the device:
    k_coef may compute it just before), a thread a tool. vectors is run-major (run_major: a warp's loads of one run
    of 8 dimensions are 32 tools' consecutive 16 bytes); a tool's runs are read once for every part, four loads in
    flight, each part's sum ascending over the dimensions."""
    tool = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if tool >= n:
        return
    s = (numba.float32(0.0), _start(1, parts), _start(2, parts), _start(3, parts), _start(4, parts),
         _start(5, parts), _start(6, parts), _start(7, parts))
    at, step = tool * 8, n * 8
    j = 0
    while j + 32 <= dim:
        x0, x1, x2, x3 = ld8(vectors, at), ld8(vectors, at + step), ld8(vectors, at + 2 * step), \
            ld8(vectors, at + 3 * step)
        s = _run(x3, queries, j + 24, dim, parts, _run(x2, queries, j + 16, dim, parts, _run(
            x1, queries, j + 8, dim, parts, _run(x0, queries, j, dim, parts, s))))
        at += 4 * step
        j += 32
    while j < dim:
        s = _run(ld8(vectors, at), queries, j, dim, parts, s)
        at += step
        j += 8
    best = max(max(max(s[0], s[1]), max(s[2], s[3])), max(max(s[4], s[5]), max(s[6], s[7])))
    out[tool] = coef[0] * best + coef[1]


def run_major(vectors: np.ndarray) -> np.ndarray:
    """float16 [n, dim] (dim a multiple of 8) as k_fuse reads it, flat: run r of tool t (its dimensions
    8r..8r + 7) at (r * n + t) * 8."""
    n, dim = vectors.shape
    return np.ascontiguousarray(np.asarray(vectors, np.float16).reshape(n, dim // 8, 8).transpose(1, 0, 2)).ravel()


@cuda.jit(cache=not SIM)
def k_moments(queries, mean, gram, dim, partial):
    """Block b's share of the intent's dense moments over every tool: for its rows i (a warp each, the lanes
    striding the columns), partial[2b] = sum of mean[i] q[i] and partial[2b + 1] = sum of q[i] (gram q)[i], q =
    queries[:dim], in float64; each lane's columns ascending, then the lanes', then the rows', in order."""
    tid = cuda.threadIdx.x
    lane, w = tid % MOMENT_LANES, tid // MOMENT_LANES
    rows = cuda.blockDim.x // MOMENT_LANES
    i = cuda.blockIdx.x * rows + w
    red = cuda.shared.array(MOMENT_THREADS, numba.float64)
    g = numba.float64(0.0)
    if i < dim:
        for j in range(lane, dim, MOMENT_LANES):
            g += gram[i * dim + j] * numba.float64(queries[j])
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


@cuda.jit(cache=not SIM)
def k_coef(partial, blocks, weight, shift, coef):
    """coef = (a, k0) of the intent's dense term from k_moments' partial sums (added in block order): its cosines
    with the tools have mean m and variance v = q.gram.q - m^2, so a = weight / sqrt(v) (0 where v is 0) and
    k0 = -a m - shift (the BM25 term's). One thread."""
    if cuda.threadIdx.x != 0 or cuda.blockIdx.x != 0:
        return
    m = q2 = numba.float64(0.0)
    for b in range(blocks):
        m += partial[2 * b]
        q2 += partial[2 * b + 1]
    sd = math.sqrt(max(q2 - m * m, 0.0))
    a = weight / sd if sd > 0 else 0.0
    coef[0] = numba.float32(a)
    coef[1] = numba.float32(-a * m - shift)


@cuda.jit(cache=not SIM)
def k_add(ids, values, m, c, out):
    """out[ids[i]] += c * values[i]: the BM25 term of the tools the query matched (distinct ids)."""
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < m:
        out[ids[i]] += c * values[i]


@cuda.jit(cache=not SIM)
def k_vote(near_scores, near_ids, owner, count, weight, temperature, out):
    """out[owner[e]] += weight * e's share of the vote, for the `count` nearest requests e (best first): a
    softmax of their cosines, in float64, added by one thread in rank order (a tool with several of them sums
    in a fixed order)."""
    if cuda.threadIdx.x != 0 or cuda.blockIdx.x != 0:
        return
    top = numba.float64(near_scores[0])
    total = numba.float64(0.0)
    for r in range(count):
        total += math.exp((numba.float64(near_scores[r]) - top) / temperature)
    for r in range(count):
        share = math.exp((numba.float64(near_scores[r]) - top) / temperature) / total
        out[owner[near_ids[r]]] += numba.float32(weight * share)


@cuda.jit(device=True, inline="always")
def _better(v, i, bv, bi):
    return v > bv or (v == bv and i < bi)


@cuda.jit(cache=not SIM)
def k_best(scores, ids, n, slice_len, top, out_scores, out_ids):
    """Block b: the best `top` of entries [b*slice_len, (b+1)*slice_len) of scores (their ids from `ids`, or
    the index where ids is empty), best first, into out_*[b*top:]. The block sorts SORT entries at a time, best
    first (a bitonic network, two entries a thread): the slice's first SORT, then the best `top` so far with the
    next SORT - top; past the slice, entries worse than any (-inf, the largest id)."""
    tid = cuda.threadIdx.x
    b = cuda.blockIdx.x
    lo = b * slice_len
    hi = min(lo + slice_len, n)
    sv = cuda.shared.array(SORT, numba.float32)
    si = cuda.shared.array(SORT, numba.int32)
    kept, p = 0, lo
    while True:
        for e in range(kept + tid, SORT, THREADS):
            q = p + e - kept
            if q < hi:
                sv[e] = scores[q]
                si[e] = ids[q] if ids.size > 0 else q
            else:
                sv[e] = -math.inf
                si[e] = LAST_ID
        p += SORT - kept
        cuda.syncthreads()
        k = 2
        while k <= SORT:
            j = k >> 1
            while j > 0:
                # the pair (i, i + j); in a run of k entries, the better first where i & k == 0
                i = ((tid & -j) << 1) | (tid & (j - 1))
                if _better(sv[i + j], si[i + j], sv[i], si[i]) == ((i & k) == 0):
                    sv[i], sv[i + j] = sv[i + j], sv[i]
                    si[i], si[i + j] = si[i + j], si[i]
                cuda.syncthreads()
                j >>= 1
            k <<= 1
        kept = top
        if p >= hi:
            break
    for r in range(tid, top, THREADS):
        out_scores[b * top + r] = sv[r]
        out_ids[b * top + r] = si[r]


class DeviceScorer:
    """One version's tool vectors (and its requests', which vote) on the device, and the buffers of its
    shortlist (one request at a time). Built with the CUDA encoder, it shares the encoder's stream and turns, so
    that `retrieve` runs the intent's encoder pass and the shortlist back to back on the device."""

    def __init__(self, vectors: np.ndarray, voters: tuple[np.ndarray, np.ndarray] | None = None, encoder=None):
        n, dim = vectors.shape
        if dim % 8:
            raise ValueError(f"k_fuse reads vectors in runs of 8, not a dimension of {dim}")
        self.n, self.dim, self.encoder = n, dim, encoder
        self.stream = encoder.stream if encoder is not None else Stream()
        self.turns = encoder.turns if encoder is not None else Turns()
        self.vectors = cuda.to_device(run_major(vectors))
        tools = np.asarray(vectors, np.float64)
        gram = tools.T @ tools / n
        self.mean = cuda.to_device(tools.mean(axis=0))                 # the cosines' moments for any intent q:
        self.gram = cuda.to_device(((gram + gram.T) / 2).ravel())      # mean @ q and q @ gram @ q
        self.moment_blocks = -(-dim // (MOMENT_THREADS // MOMENT_LANES))
        self.partial = cuda.device_array(2 * self.moment_blocks, np.float64)
        self.queries = cuda.device_array(MAX_PARTS * dim, np.float32)
        self.coef = cuda.device_array(2, np.float32)
        self.scores = cuda.device_array(n, np.float32)
        self.no_ids = cuda.device_array(0, np.int32)
        self.matched_ids = cuda.device_array(n, np.int32)
        self.matched_values = cuda.device_array(n, np.float32)
        pin = np.zeros if SIM else cuda.pinned_array
        self.host_queries, self.host_coef = pin(MAX_PARTS * dim, np.float32), pin(2, np.float32)
        self.host_ids, self.host_values = pin(n, np.int32), pin(n, np.float32)
        self.out_ids, self.out_scores = pin(MAX_N, np.int32), pin(MAX_N, np.float32)
        # the launches, packed once; what changes per request is in these scalars
        self.c, self.weight = Scalar(ctypes.c_float), Scalar(ctypes.c_float)
        self.dense, self.shift = Scalar(ctypes.c_double), Scalar(ctypes.c_double)
        self.m, self.top, self.parts = (Scalar(ctypes.c_int32) for _ in range(3))
        k, h = Kernels.get(), self.stream.handle
        self.moments = Launch(k.moments, MOMENT_THREADS, 0, dict(queries=self.queries, mean=self.mean, gram=self.gram,
                                                                  dim=dim, partial=self.partial), h)
        self.coefficients = Launch(k.coef, 1, 0, dict(partial=self.partial, blocks=self.moment_blocks,
                                                      weight=self.dense, shift=self.shift, coef=self.coef), h)
        self.fuse = Launch(k.fuse, FUSE_THREADS, 0, dict(vectors=self.vectors, dim=dim, n=n, queries=self.queries,
                                                         parts=self.parts, coef=self.coef, out=self.scores), h)
        self.add = Launch(k.add, 256, 0, dict(ids=self.matched_ids, values=self.matched_values, m=self.m, c=self.c,
                                              out=self.scores), h)
        self.best = Best(self.scores, n, self.top, MAX_N, self.no_ids, h)
        self.vote = None
        if voters is not None and len(voters[1]):
            requests, owner = voters
            count = min(NEIGHBOURS, len(owner))
            self.requests = cuda.to_device(run_major(requests))
            self.request_scores = cuda.device_array(len(owner), np.float32)
            self.owner = cuda.to_device(np.ascontiguousarray(owner, np.int32))
            self.request_fuse = Launch(k.fuse, FUSE_THREADS, 0, dict(
                vectors=self.requests, dim=dim, n=len(owner), queries=self.queries, parts=self.parts,
                coef=cuda.to_device(np.array([1.0, 0.0], np.float32)), out=self.request_scores), h)
            self.nearest = Best(self.request_scores, len(owner), Scalar(ctypes.c_int32, count), count, self.no_ids, h)
            self.vote = Launch(k.vote, 1, 0, dict(
                near_scores=self.nearest.scores, near_ids=self.nearest.ids, owner=self.owner, count=count,
                weight=self.weight, temperature=VOTE_TEMPERATURE, out=self.scores), h)

    def shortlist(self, queries: np.ndarray, a: float, k0: float, matched: tuple[np.ndarray, np.ndarray], c: float,
                  top: int, vote_weight: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """(ids, scores) of the `top` best tools by a * (best cosine over the rows of queries) + k0 + c*bm25
        (matched = the BM25 index's (ids, values) of the tools with a nonzero score) + vote_weight * the
        requests' votes (retrieval.Retriever.votes), best first."""
        self._check(top, len(queries))
        with self.turns:
            self.host_queries[:queries.size] = queries.ravel()
            self.host_coef[:] = a, k0
            self.stream.h2d(self.queries, self.host_queries, queries.size)
            self.stream.h2d(self.coef, self.host_coef, 2)
            self.parts.value = len(queries)
            return self._finish(matched, c, top, vote_weight)

    def retrieve(self, seqs: list[np.ndarray], dense: float, lexical, top: int,
                 vote_weight: float) -> tuple[np.ndarray, np.ndarray]:
        """shortlist's (ids, scores) for the intent's parts (seqs: their token ids), their vectors encoded on the
        device and never copied out: the dense term standardised over every tool (k_moments, k_coef) and weighted
        by `dense`. lexical() -> (ids, values, c, shift): BM25's matched tools and c * bm25 - shift, its
        standardised, weighted term, computed on the host while the device encodes."""
        if self.encoder is None:
            raise ValueError("retrieve encodes on the device: build the scorer with the CUDA encoder")
        self._check(top, len(seqs))
        with self.turns:
            emb = self.encoder.enqueue(seqs)
            self.stream.d2d(self.queries, emb, len(seqs) * self.dim)
            self.parts.value = len(seqs)
            self.moments.launch(self.moment_blocks)
            ids, values, c, shift = lexical()
            self.dense.value, self.shift.value = dense, shift
            self.coefficients.launch(1)
            return self._finish((ids, values), c, top, vote_weight)

    def _check(self, top: int, parts: int) -> None:
        if top > MAX_N or top > self.n:
            raise ValueError(f"the device shortlist holds 1 to {min(MAX_N, self.n)} tools, asked for {top}")
        if not 1 <= parts <= MAX_PARTS:
            raise ValueError(f"the device scorer takes 1 to {MAX_PARTS} query vectors, got {parts}")

    def _finish(self, matched: tuple[np.ndarray, np.ndarray], c: float, top: int,
                vote_weight: float) -> tuple[np.ndarray, np.ndarray]:
        """Enqueue the shortlist behind the queries and coef (in this caller's turn), wait, and return it."""
        ids, values = matched
        s, m = self.stream, len(ids)
        self.host_ids[:m], self.host_values[:m] = ids, values
        self.c.value, self.weight.value = c, vote_weight
        self.m.value, self.top.value = m, top
        s.h2d(self.matched_ids, self.host_ids, m)
        s.h2d(self.matched_values, self.host_values, m)
        self.fuse.launch(-(-self.n // FUSE_THREADS))
        if self.vote is not None and vote_weight:
            self.request_fuse.launch(-(-len(self.owner) // FUSE_THREADS))
            self.nearest.launch()
            self.vote.launch(1)
        if m:
            self.add.launch(-(-m // 256))
        self.best.launch()
        s.d2h(self.out_ids, self.best.ids, top)
        s.d2h(self.out_scores, self.best.scores, top)
        s.synchronize()
        return self.out_ids[:top].copy(), self.out_scores[:top].copy()


class Best:
    """The k_best launches that leave the best `top` (at most `most`) of scores[:n] in two small device arrays,
    `scores` and `ids`: each slice's best, then (over more than one slice) the best of those."""

    def __init__(self, scores, n: int, top: Scalar, most: int, no_ids, stream):
        if most >= SORT:
            raise ValueError(f"k_best keeps fewer than {SORT} entries, asked for {most}")
        self.blocks, self.top, self.merged = -(-n // SORT), top, Scalar(ctypes.c_int32)
        self.scores, self.ids = cuda.device_array(most, np.float32), cuda.device_array(most, np.int32)
        part_scores, part_ids = self.scores, self.ids     # one slice: its best are the best
        if self.blocks > 1:
            part_scores = cuda.device_array(self.blocks * most, np.float32)
            part_ids = cuda.device_array(self.blocks * most, np.int32)
        k = Kernels.get()
        self.part = Launch(k.best, THREADS, 0, dict(scores=scores, ids=no_ids, n=n, slice_len=SORT, top=top,
                                                    out_scores=part_scores, out_ids=part_ids), stream)
        self.merge = Launch(k.best, THREADS, 0, dict(scores=part_scores, ids=part_ids, n=self.merged,
                                                     slice_len=self.merged, top=top, out_scores=self.scores,
                                                     out_ids=self.ids), stream)

    def launch(self) -> None:
        self.merged.value = self.blocks * self.top.value
        self.part.launch(self.blocks)
        if self.blocks > 1:
            self.merge.launch(1)


class Kernels:
    """The kernels, compiled once per process."""

    _instance = None

    def __init__(self):
        self.fuse = Kernel("k_fuse", dispatcher=k_fuse, argtypes=(_H, _S, _S, _F, _S, _F, _F))
        self.moments = Kernel("k_moments", dispatcher=k_moments, argtypes=(_F, _D, _D, _S, _D))
        self.coef = Kernel("k_coef", dispatcher=k_coef, argtypes=(_D, _S, t.float64, t.float64, _F))
        self.add = Kernel("k_add", dispatcher=k_add, argtypes=(_I, _F, _S, _X, _F))
        self.best = Kernel("k_best", dispatcher=k_best, argtypes=(_F, _I, _S, _S, _S, _F, _I))
        self.vote = Kernel("k_vote", dispatcher=k_vote, argtypes=(_F, _I, _I, _S, _X, t.float64, _F))

    @classmethod
    def get(cls) -> "Kernels":
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

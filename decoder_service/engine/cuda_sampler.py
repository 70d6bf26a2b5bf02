"""The trie-masked sampler on the GPU: two kernels around the model's sparse head, one block per row.

  k_mask   reads the row's current node from the trie (constant memory when the row's catalog version
           is the resident one, else the global trie arena), keeps the legal edges (sampler.py's rule)
           in edge order and writes them as the row's candidates;
  (the model's sparse head computes the candidates' logits)
  k_select takes the argmax over the candidates' logits (fixed reduction tree, lower token id on a
           tie), the log-softmax over them, and advances the row: node, emitted pointers, and `done`,
           whether the pick ended the row's answer as the engine will see it (the stop, a last name
           that is the only one left below its node where the engine finishes those, or no
           candidate): a step launched ahead of the row runs only while some row's is 0
           (backend.forward's skip_if_done).

A packed trie is one int32 array: [nodes + 1, edges, node_edge_start..., edge_token..., edge_child...,
edge_lo..., edge_hi...]. Constant memory holds one packed trie (64 KiB); `ConstantTrie.bind` rewrites
it from the host (in stream order), and whoever replays a captured graph that reads it must bind
first: graph replay replays kernels, not the host upload that filled the symbol.

The kernels are launched like the model's (decoder_service/model/cuda/launcher.py): compiled once for
the signatures below, parameters packed once, raw cuLaunchKernel on the backend's stream. Per-row
emitted pointers are one flat int32 array with a row stride, so every argument is a 1-D array.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numba
import numpy as np

from decoder_service.model.cuda.launcher import Kernel, Launch, check, event_wait_host, new_event  # numpy fix first
from numba import cuda  # noqa: E402

from decoder_service.engine.sampler import Pick, empty_mask_message  # noqa: E402
from shared.trie import SEP, STOP, Trie

SIM = bool(getattr(numba.config, "ENABLE_CUDASIM", 0))
THREADS = 8 if SIM else 128
CONST_WORDS = 16384                        # 64 KiB of int32
# The kernel's constant-memory image, rewritten by ConstantTrie.bind. Its initial content is never read,
# but it must not be uniform: a load from a constant array that is all zeros is folded to 0 by the
# compiler, whatever the index, and the rebinding would be silently ignored (seen on the H200).
CONST_TRIE = np.arange(CONST_WORDS, dtype=np.int32)
OK, EMPTY_MASK, TOO_MANY = 0, 1, 2         # per-row status written by k_mask
_I, _S, _F = numba.int32[::1], numba.int32, numba.float32[::1]
# k_mask(arena, row_base, row_const, node, emitted, kstride, n_emitted, k, allow, allow_start, allow_len,
#        prior, row_prior, forced, cand_token, cand_child, cand_lo, cand_edge, cand_ends, cand_bias, ncand, cmax,
#        status)
MASK_SIGNATURE = (_I,) * 5 + (_S,) + (_I,) * 5 + (_F, _I, _S) + (_I,) * 5 + (_F, _I, _S, _I)
# k_select(logits, logit_stride, cand_token, cand_child, cand_lo, cand_edge, cand_ends, cand_bias, ncand, cmax,
#          status, node, emitted, kstride, n_emitted, done, out_token, out_edge, out_logprob)
SELECT_SIGNATURE = ((_F, _S) + (_I,) * 5 + (_F, _I, _S) + (_I,) * 3 + (_S,) + (_I,) * 4
                    + (numba.float64[::1],))


def pack_trie(trie: Trie) -> np.ndarray:
    """The trie as one int32 array, the layout both trie paths read."""
    return np.concatenate([np.asarray([trie.num_nodes + 1, trie.num_edges], np.int32), trie.node_edge_start,
                           trie.edge_token, trie.edge_child, trie.edge_lo, trie.edge_hi]).astype(np.int32)


def fits_constant_memory(packed: np.ndarray) -> bool:
    return len(packed) <= CONST_WORDS


@cuda.jit(device=True, inline="always")
def _rd(cmem, arena, use_const, base, i):
    """Word i of the row's packed trie. A resident trie starts at word 0 of constant memory and its
    rows carry base 0: indexing with the runtime base keeps the compiler from folding the load."""
    if use_const:
        return cmem[base + i]
    return arena[base + i]


@cuda.jit(device=True, inline="always")
def _lower_bound(sorted_ids, a, b, x):
    """First index in [a, b) whose id is >= x."""
    while a < b:
        m = (a + b) // 2
        if sorted_ids[m] < x:
            a = m + 1
        else:
            b = m
    return a


@cuda.jit(device=True, inline="always")
def _legal(cmem, arena, use_const, base, e, tok_off, n_emitted, k, emitted, e0, allow, a0, alen):
    E = _rd(cmem, arena, use_const, base, 1)
    child = _rd(cmem, arena, use_const, base, tok_off + E + e)
    if child == SEP and n_emitted + 1 >= k:
        return False
    if child == STOP and n_emitted + 1 != k:
        return False
    lo = _rd(cmem, arena, use_const, base, tok_off + 2 * E + e)
    hi = _rd(cmem, arena, use_const, base, tok_off + 3 * E + e)
    if alen < 0:
        count = hi - lo
    else:  # allowed ids in [lo, hi): two binary searches over the row's sorted allowlist
        first = _lower_bound(allow, a0, a0 + alen, lo)
        count = _lower_bound(allow, first, a0 + alen, hi) - first
    for i in range(n_emitted):
        p = emitted[e0 + i]
        if lo <= p and p < hi:
            count -= 1
    return count > 0


@cuda.jit(device=True, inline="always")
def _edge_prior(lo, hi, emitted, e0, n_emitted, allow, prior, a0, alen):
    """sampler.edge_prior: the highest prior of the row's allowed, not yet emitted pointers in [lo, hi)."""
    best = -math.inf
    first = _lower_bound(allow, a0, a0 + alen, lo)
    for j in range(first, _lower_bound(allow, first, a0 + alen, hi)):
        taken = False
        for i in range(n_emitted):
            taken = taken or emitted[e0 + i] == allow[j]
        if not taken and prior[j] > best:
            best = prior[j]
    return best


@cuda.jit(cache=not SIM)
def k_mask(arena, row_base, row_const, node, emitted, kstride, n_emitted, k, allow, allow_start, allow_len,
           prior, row_prior, forced, cand_token, cand_child, cand_lo, cand_edge, cand_ends, cand_bias, ncand, cmax,
           status):
    """One block per row: the row's legal edges, in edge order, as its candidates, each with whether
    taking it ends the answer: the stop, or (forced: the engine's finish_forced) on the last pointer, an
    edge with one pointer below (engine._take_forced completes the answer from there); and its bias: the
    retrieval prior of its best pointer where the row has priors (beside its allowlist), else 0."""
    cmem = cuda.const.array_like(CONST_TRIE)
    r = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    counts = cuda.shared.array(THREADS, numba.int32)
    base, use_const = row_base[r], row_const[r]
    n1 = _rd(cmem, arena, use_const, base, 0)
    E = _rd(cmem, arena, use_const, base, 1)
    tok_off = 2 + n1
    nd = node[r]
    e0 = _rd(cmem, arena, use_const, base, 2 + nd)
    e1 = _rd(cmem, arena, use_const, base, 3 + nd)
    chunk = (e1 - e0 + THREADS - 1) // THREADS
    lo_e = e0 + tid * chunk
    hi_e = min(lo_e + chunk, e1)
    ne, kk, a0, alen, em0 = n_emitted[r], k[r], allow_start[r], allow_len[r], r * kstride
    c = 0
    for e in range(lo_e, hi_e):
        if _legal(cmem, arena, use_const, base, e, tok_off, ne, kk, emitted, em0, allow, a0, alen):
            c += 1
    counts[tid] = c
    cuda.syncthreads()
    if tid == 0:  # exclusive scan, serial over the block: a fixed order, so the candidates are too
        total = 0
        for t in range(THREADS):
            v = counts[t]
            counts[t] = total
            total += v
        ncand[r] = min(total, cmax)
        status[r] = OK if 0 < total <= cmax else (EMPTY_MASK if total == 0 else TOO_MANY)
    cuda.syncthreads()
    out = counts[tid]
    for e in range(lo_e, hi_e):
        if _legal(cmem, arena, use_const, base, e, tok_off, ne, kk, emitted, em0, allow, a0, alen):
            if out < cmax:
                j = r * cmax + out
                child = _rd(cmem, arena, use_const, base, tok_off + E + e)
                lo = _rd(cmem, arena, use_const, base, tok_off + 2 * E + e)
                hi = _rd(cmem, arena, use_const, base, tok_off + 3 * E + e)
                cand_token[j] = _rd(cmem, arena, use_const, base, tok_off + e)
                cand_child[j] = child
                cand_lo[j] = lo
                cand_edge[j] = e
                cand_ends[j] = child == STOP or (forced != 0 and child != SEP and ne + 1 == kk and hi - lo == 1)
                cand_bias[j] = 0.0
                if row_prior[r] != 0:
                    cand_bias[j] = _edge_prior(lo, hi, emitted, em0, ne, allow, prior, a0, alen)
            out += 1


@cuda.jit(device=True, inline="always")
def _better(v, t, bv, bt):
    """Is (v, token t) a better winner than (bv, bt)? Higher logit; the lower token id on a tie."""
    return v > bv or (v == bv and t < bt)


@cuda.jit(cache=not SIM)
def k_select(logits, logit_stride, cand_token, cand_child, cand_lo, cand_edge, cand_ends, cand_bias, ncand, cmax,
             status, node, emitted, kstride, n_emitted, done, out_token, out_edge, out_logprob):
    """One block per row: argmax of logit + bias over the candidates, log-softmax of the logits over them,
    and the trie advance."""
    r = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    bv = cuda.shared.array(THREADS, numba.float32)
    bt = cuda.shared.array(THREADS, numba.int32)
    bi = cuda.shared.array(THREADS, numba.int32)
    sm = cuda.shared.array(THREADS, numba.float64)  # running max of the logits
    ss = cuda.shared.array(THREADS, numba.float64)  # sum of exp(logit - running max)
    n = ncand[r] if status[r] == OK else 0
    v_best, t_best, i_best = -math.inf, 2147483647, -1
    m, s = -math.inf, 0.0
    for i in range(tid, n, THREADS):
        v = logits[r * logit_stride + i]
        t = cand_token[r * cmax + i]
        f = v + cand_bias[r * cmax + i]
        if _better(f, t, v_best, t_best):
            v_best, t_best, i_best = f, t, i
        x = numba.float64(v)
        if x > m:
            s = s * math.exp(m - x) + 1.0
            m = x
        else:
            s += math.exp(x - m)
    bv[tid], bt[tid], bi[tid], sm[tid], ss[tid] = v_best, t_best, i_best, m, s
    cuda.syncthreads()
    stride = THREADS // 2
    while stride > 0:  # a fixed tree: the same pairs combine whatever else is in the batch
        if tid < stride:
            o = tid + stride
            if _better(bv[o], bt[o], bv[tid], bt[tid]):
                bv[tid], bt[tid], bi[tid] = bv[o], bt[o], bi[o]
            if ss[o] > 0.0:
                if ss[tid] == 0.0:
                    sm[tid], ss[tid] = sm[o], ss[o]
                elif sm[o] > sm[tid]:
                    ss[tid] = ss[tid] * math.exp(sm[tid] - sm[o]) + ss[o]
                    sm[tid] = sm[o]
                else:
                    ss[tid] = ss[tid] + ss[o] * math.exp(sm[o] - sm[tid])
        cuda.syncthreads()
        stride //= 2
    if tid == 0:
        w = bi[0]
        if w < 0:
            # no candidate: k_mask's status says why, and the row does not move; its token is a valid
            # id (0), since a step launched ahead embeds it before the host reads the status
            out_token[r] = 0
            out_edge[r] = -1
            done[r] = 1      # the engine fails the row
            return
        j = r * cmax + w
        child = cand_child[j]
        out_token[r] = cand_token[j]
        out_edge[r] = cand_edge[j]
        out_logprob[r] = numba.float64(logits[r * logit_stride + w]) - (sm[0] + math.log(ss[0]))
        done[r] = cand_ends[j]
        if child == SEP or child == STOP:
            emitted[r * kstride + n_emitted[r]] = cand_lo[j]
            n_emitted[r] += 1
            node[r] = 0
        else:
            node[r] = child


class SamplerKernels:
    """k_mask and k_select compiled once per process (numba's disk cache makes a restart cheap)."""

    _instance = None

    def __init__(self):
        self.mask = Kernel("k_mask", dispatcher=k_mask, argtypes=MASK_SIGNATURE)
        self.select = Kernel("k_select", dispatcher=k_select, argtypes=SELECT_SIGNATURE)

    @classmethod
    def get(cls) -> "SamplerKernels":
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance


def sampler_launches(kernels: SamplerKernels, stream, arena, rows: dict, kstride: int, allow, prior, forced: bool,
                     cand: dict, cmax: int, logits, picks: dict) -> tuple[Launch, Launch]:
    """k_mask and k_select with their arguments packed (the one place that knows their order), on the
    stream handle `stream`, for these device buffers:
    rows    the int32 [n] arrays named by DeviceSampler.FIELDS, and "emitted" [n * kstride];
    allow   the rows' allowlists, one int32 array (a row's: allow_start, allow_len; -1: all allowed);
    prior   float32 beside allow: each allowed pointer's retrieval prior (read where rows["prior"] is 1);
    forced  the engine's finish_forced (what `done` means);
    cand    "token", "child", "lo", "edge", "ends" [n * cmax] and "count", "status" [n] (int32), "bias"
            [n * cmax] (float32);
    logits  float32 [n * cmax], the sparse head's logits of the candidates;
    picks   "done", "token", "edge" (int32 [n]) and "logprob" (float64 [n])."""
    mask = Launch(kernels.mask, THREADS, 0,
                  [arena, rows["base"], rows["const"], rows["node"], rows["emitted"], kstride, rows["n_emitted"],
                   rows["k"], allow, rows["allow_start"], rows["allow_len"], prior, rows["prior"], int(forced),
                   cand["token"], cand["child"], cand["lo"], cand["edge"], cand["ends"], cand["bias"], cand["count"],
                   cmax, cand["status"]], stream)
    select = Launch(kernels.select, THREADS, 0,
                    [logits, cmax, cand["token"], cand["child"], cand["lo"], cand["edge"], cand["ends"], cand["bias"],
                     cand["count"], cmax, cand["status"], rows["node"], rows["emitted"], kstride, rows["n_emitted"],
                     picks["done"], picks["token"], picks["edge"], picks["logprob"]], stream)
    return mask, select


class ConstantTrie:
    """Residency of one catalog version in k_mask's constant memory, re-bound on every switch."""

    def __init__(self, kernels: SamplerKernels):
        self.kernels = kernels
        self.owner = None

    def bind(self, owner, packed: np.ndarray, stream) -> None:
        """Make packed (owned by `owner`, e.g. a catalog's (name, version)) the resident trie, in the
        order of `stream` (the backend's Stream)."""
        if not fits_constant_memory(packed):
            raise ValueError(f"a packed trie of {len(packed) * 4} bytes does not fit 64 KiB of constant memory")
        if SIM:
            CONST_TRIE[:len(packed)] = packed
        else:
            from cuda.bindings import driver
            # numba-private: the compiled module's symbol for the const array (GPU_NOTES), in one place
            pointer, size = self.kernels.mask.module.get_global_symbol("_cudapy_cmem")
            host = cuda.pinned_array(CONST_WORDS, np.int32)  # a fresh buffer: the copy is asynchronous
            host[:] = 0
            host[:len(packed)] = packed
            check(driver.cuMemcpyHtoDAsync(int(pointer.device_ctypes_pointer.value), host.ctypes.data, size,
                                           stream.handle), "bind the constant trie")
            self._keepalive = host
        self.owner = owner


class DeviceSampler:
    """The engine's sampler on a GPU backend: k_mask -> the backend's sparse head -> k_select.

    The rows' trie state stays on the host (the engine's source of truth). `start` stages it in one
    pinned buffer, makes one copy in, three raw launches on the backend's stream and one copy out;
    `finish` waits for that copy. `follow` enqueues the same rows' next choice from the state k_select
    left on the device, before the host has read the previous picks (the engine's step ahead). Every
    loaded catalog version has its packed trie in a global arena; the newest version that fits 64 KiB
    is resident in constant memory and its rows read from there. A step the kernels cannot take whole
    (a node wider than the backend's candidate buffer, a k or an allowlist past the staging buffers)
    goes to the host sampler, which tiles: no candidate is dropped.
    """

    FIELDS = ("base", "const", "node", "n_emitted", "k", "allow_start", "allow_len", "prior")  # int32 per row

    def __init__(self, backend, fallback, max_k: int = 64, max_allow: int = 1 << 16, finish_forced: bool = True):
        """finish_forced: the engine's setting of that name (whether a last name left alone below its node
        ends the answer at the pick that enters it), so that the done flags say what the engine will."""
        self.be, self.fallback, self.max_k, self.max_allow = backend, fallback, max_k, max_allow
        self.kernels = SamplerKernels.get()
        self.constant = ConstantTrie(self.kernels)
        self.packed: dict = {}   # catalog key -> packed trie
        self.base: dict = {}     # catalog key -> offset in the arena
        n, c = backend.max_logit_rows, backend.max_candidates
        pin = np.zeros if SIM else cuda.pinned_array
        # staged inputs: the per-row fields, then emitted [n, max_k], the rows' allowlists, and their priors
        # (float32 words, beside the allowlists)
        self._o_emitted = len(self.FIELDS) * n
        self._o_allow = self._o_emitted + n * max_k
        self._o_prior = self._o_allow + max_allow
        self.host_in = pin(self._o_prior + max_allow, np.int32)
        self.host_prior = self.host_in[self._o_prior:].view(np.float32)
        self.dev_in = cuda.device_array(len(self.host_in), np.int32)
        self.host_fields = {f: self.host_in[i * n:(i + 1) * n] for i, f in enumerate(self.FIELDS)}
        dev_fields = {f: self.dev_in[i * n:(i + 1) * n] for i, f in enumerate(self.FIELDS)}
        emitted = self.dev_in[self._o_emitted:self._o_allow]
        allow = self.dev_in[self._o_allow:self._o_prior]
        prior = self.dev_in[self._o_prior:].view(np.float32)
        # outputs: status | token | edge (int32), and the log-probabilities; two host copies, used in
        # turn, so that the next step's picks can arrive while the host reads this step's
        self.dev_out, self.dev_logprob = cuda.device_array(3 * n, np.int32), cuda.device_array(n, np.float64)
        self.host_out = [pin(3 * n, np.int32) for _ in range(2)]
        self.host_logprob = [pin(n, np.float64) for _ in range(2)]
        self.out_ready = [new_event() for _ in range(2)]
        self._next_out = 0
        status, token, edge = (self.dev_out[i * n:(i + 1) * n] for i in range(3))
        self.dev_token = token
        self.done = cuda.device_array(n, np.int32)
        # k_mask's and k_select's buffers (sampler_launches); the launches are packed once an arena exists,
        # and again whenever it grows
        self._buffers = dict(
            rows={**dev_fields, "emitted": emitted}, kstride=max_k, allow=allow, prior=prior, forced=finish_forced,
            cand={"token": backend.cand, "count": backend.ncand, "status": status,
                  **{key: cuda.device_array(n * c, np.int32) for key in ("child", "lo", "edge", "ends")},
                  "bias": cuda.device_array(n * c, np.float32)},
            cmax=c, logits=backend.sparse, picks={"done": self.done, "token": token, "edge": edge,
                                                  "logprob": self.dev_logprob})
        self.launch_mask = self.launch_select = None

    def _register(self, catalog) -> None:
        """Put a version's packed trie in the arena (once), and in constant memory if it fits."""
        key = catalog.key
        if key in self.packed:
            return
        self.packed[key] = pack_trie(catalog.trie)
        self.base, offset = {}, 0
        for k, p in self.packed.items():
            self.base[k] = offset
            offset += len(p)
        self.arena = cuda.to_device(np.concatenate(list(self.packed.values())))
        self.launch_mask, self.launch_select = sampler_launches(self.kernels, self.be.stream.handle, self.arena,
                                                                **self._buffers)
        if fits_constant_memory(self.packed[key]):
            self.constant.bind(key, self.packed[key], self.be.stream)

    def forget(self, catalog) -> None:
        """A released version leaves the arena at the next registration (constant memory keeps it until
        another version is bound: nothing reads it once no row names it)."""
        self.packed.pop(catalog.key, None)

    def start(self, seqs) -> "DevicePicks | list":
        """Enqueue the choice for `seqs` (their trie state staged from the host); the host sampler's
        picks, computed now, for a step the kernels cannot take whole."""
        n = len(seqs)
        allow_total = sum(len(s.allow) for s in seqs if not s.allow_all)
        if (n > self.be.max_logit_rows or allow_total > self.max_allow
                or any(most_candidates(s) > self.be.max_candidates or s.k > self.max_k for s in seqs)):
            return self.fallback.choose(seqs)
        for seq in seqs:
            self._register(seq.catalog)
        f, offset = self.host_fields, 0
        for i, seq in enumerate(seqs):
            resident = self.constant.owner == seq.catalog.key
            f["base"][i] = 0 if resident else self.base[seq.catalog.key]
            f["const"][i] = resident
            f["node"][i], f["n_emitted"][i], f["k"][i] = seq.node, seq.n_emitted, seq.k
            row = self._o_emitted + i * self.max_k
            self.host_in[row:row + seq.n_emitted] = seq.emitted[:seq.n_emitted]
            f["allow_start"][i] = offset
            f["allow_len"][i] = -1 if seq.allow_all else len(seq.allow)
            f["prior"][i] = seq.prior is not None
            if not seq.allow_all:
                self.host_in[self._o_allow + offset:self._o_allow + offset + len(seq.allow)] = seq.allow
                if seq.prior is not None:
                    self.host_prior[offset:offset + len(seq.allow)] = seq.prior
                offset += len(seq.allow)
        self.be.stream.h2d(self.dev_in, self.host_in, self._o_allow + offset)
        if any(seq.prior is not None for seq in seqs):
            self.be.stream.h2d(self.dev_in[self._o_prior:], self.host_in[self._o_prior:], offset)
        return self._enqueue(seqs)

    def follow(self, picks: "DevicePicks") -> "DevicePicks":
        """Enqueue the next choice for the same rows from the trie state `picks`' k_select left on the
        device (node, emitted pointers): nothing is staged, so it may run before the host reads `picks`."""
        return self._enqueue(picks.seqs)

    @staticmethod
    def next_tokens(picks):
        """The device buffer holding the picked tokens (row i: row i's), for the next step's forward;
        None for picks made on the host. A row with no candidate holds token 0 there, a valid id."""
        return picks.tokens if isinstance(picks, DevicePicks) else None

    def done_flags(self, picks):
        """The device buffer of whether each row's answer ended at `picks` (row i: row i's), for a step
        launched ahead of them to run only if some row is still live; None for picks made on the host."""
        return self.done if isinstance(picks, DevicePicks) else None

    def _enqueue(self, seqs) -> "DevicePicks":
        """k_mask, the sparse head and k_select for rows 0..n-1, then their copy out into the host buffers
        not used by the step before (a step may be enqueued while the host still reads the previous one)."""
        n, b = len(seqs), self._next_out
        self._next_out ^= 1
        self.launch_mask.launch(n)
        self.be.launch_sparse(n)
        self.launch_select.launch(n)
        stream = self.be.stream
        stream.d2h(self.host_out[b], self.dev_out, len(self.host_out[b]))
        stream.d2h(self.host_logprob[b], self.dev_logprob, n)
        stream.record(self.out_ready[b])
        return DevicePicks(seqs, b, self.dev_token)

    def finish(self, picks) -> list:
        """Wait for enqueued picks (host-sampler picks are returned as they are): a Pick per row, or a
        message saying why there is none."""
        if not isinstance(picks, DevicePicks):
            return picks
        event_wait_host(self.out_ready[picks.buffer])
        rows, out, logprob = self.be.max_logit_rows, self.host_out[picks.buffer], self.host_logprob[picks.buffer]
        n = len(picks.seqs)
        status, token, edge = (out[i * rows:i * rows + n] for i in range(3))
        return [Pick(int(edge[i]), int(token[i]), float(logprob[i])) if status[i] == OK
                else empty_mask_message(seq) for i, seq in enumerate(picks.seqs)]


def most_candidates(seq) -> int:
    """The most legal edges a row can have at any node: the trie's widest node, or with an allowlist (a
    shortlist) one edge per allowed pointer plus the two control edges, whichever is fewer."""
    if seq.allow_all:
        return seq.catalog.max_fanout
    return min(seq.catalog.max_fanout, len(seq.allow) + 2)


class DevicePicks(NamedTuple):
    """A choice enqueued on the device: its rows, the host buffers its picks arrive in, and the device
    buffer of its tokens."""
    seqs: list
    buffer: int
    tokens: object

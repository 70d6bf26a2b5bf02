"""The catalog tries on the device, in one place: packed (`pack_trie`), placed (constant memory up to 64 KiB,
else the global arena: `fits_constant_memory`), made resident when a version becomes the default or is first
pinned (`DeviceTrie.bind`, off the decode step), and read by the pick's two kernels, one block per row, around
the model's sparse head: k_mask writes a row's legal edges as its candidates, k_select picks among their logits
and advances the row. The engine's DeviceSampler (cuda_sampler.py) drives it over the CUDA backend's candidate
buffers; the engine itself only sees the sampler.

A packed trie is one int32 array: [nodes + 1, edges, node_edge_start..., edge_token..., edge_child..., edge_lo...,
edge_hi...]. Every bound version's is in one global arena; the default version, where its packed trie fits 64 KiB,
is also bound to k_mask's constant memory and its rows read it there (the same words: the same answers either
way). CatalogManager.make_default (and the first pin of an older version, arena only) asks the engine to bind the
version (DecodeEngine.make_resident); the engine thread does it at its next step, before any request queued after
the switch, so no decode step of the new version uploads anything (DeviceSampler.lazy_binds counts versions bound
inside a step instead: the engine was not told). A bind that moves a version starts a new placement epoch, and
the engine does not step ahead of picks staged before it. Whoever replays a captured graph that reads constant
memory must bind first: graph replay replays kernels, not the host upload that filled the symbol.
"""
from __future__ import annotations

import math

import numba
import numpy as np

from decoder_service.gpu import compat  # noqa: F401  (numpy row_stack alias before numba-cuda compiles anything)
from decoder_service.gpu.intrinsics import SIM
from decoder_service.gpu.launcher import Kernel, Launch, check, event_wait_host, new_event

from numba import cuda

from shared.trie import CONSTANT_MEMORY_BUDGET, PACKED_HEADER_WORDS, SEP, STOP, Trie, control_edge_legal
from shared.trie import fits_constant_memory as _placement_rule

THREADS = 8 if SIM else 128
CONST_WORDS = CONSTANT_MEMORY_BUDGET // 4   # constant memory as int32 words: room for one packed trie
# The kernel's constant-memory image, rewritten by ConstantTrie.bind. Its initial content is never read,
# but it must not be uniform: a load from a constant array that is all zeros is folded to 0 by the
# compiler, whatever the index, and the rebinding would be silently ignored (seen on the H200: P09,
# docs/gpu.md#constant-memory).
CONST_TRIE = np.arange(CONST_WORDS, dtype=np.int32)
OK, EMPTY_MASK, TOO_MANY = 0, 1, 2         # per-row status written by k_mask
_I, _S, _F = numba.int32[::1], numba.int32, numba.float32[::1]
control_legal = cuda.jit(device=True, inline="always")(control_edge_legal)   # the exactly-k rule, on the device


def pack_trie(trie: Trie) -> np.ndarray:
    """The trie as one int32 array, the layout both placements hold: [nodes + 1, edges, node_edge_start...,
    edge_token..., edge_child..., edge_lo..., edge_hi...] (Trie.packed_nbytes bytes)."""
    header = np.asarray([trie.num_nodes + 1, trie.num_edges], np.int32)
    assert len(header) == PACKED_HEADER_WORDS
    return np.concatenate([header, trie.node_edge_start, trie.edge_token, trie.edge_child, trie.edge_lo,
                           trie.edge_hi]).astype(np.int32)


def fits_constant_memory(packed: np.ndarray) -> bool:
    """shared.trie's placement rule (up to 64 KiB in constant memory, else the global arena only), on a packed
    trie."""
    return _placement_rule(packed.nbytes)


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
    if not control_legal(child, n_emitted, k):
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

# k_mask's parameter types, in its parameters' order (sampler_launches passes them by name)
MASK_SIGNATURE = (_I,) * 5 + (_S,) + (_I,) * 5 + (_F, _I, _S) + (_I,) * 5 + (_F, _I, _S, _I)



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


# k_select's parameter types, in its parameters' order
SELECT_SIGNATURE = ((_F, _S) + (_I,) * 5 + (_F, _I, _S) + (_I,) * 3 + (_S,) + (_I,) * 4
                    + (numba.float64[::1],))


class TrieKernels:
    """k_mask and k_select compiled once per process (numba's disk cache makes a restart cheap)."""

    _instance = None

    def __init__(self):
        self.mask = Kernel("k_mask", k_mask, MASK_SIGNATURE)
        self.select = Kernel("k_select", k_select, SELECT_SIGNATURE)

    @classmethod
    def get(cls) -> "TrieKernels":
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance


def sampler_launches(kernels: TrieKernels, stream, arena, rows: dict, kstride: int, allow, prior, forced: bool,
                     cand: dict, cmax: int, logits, picks: dict) -> tuple[Launch, Launch]:
    """k_mask and k_select with their arguments packed, on the stream handle `stream`, for these device buffers:
    rows    the int32 [n] arrays named by DeviceTrie.FIELDS, and "emitted" [n * kstride];
    allow   the rows' allowlists, one int32 array (a row's: allow_start, allow_len; -1: all allowed);
    prior   float32 beside allow: each allowed pointer's retrieval prior (read where rows["prior"] is 1);
    forced  the engine's finish_forced (what `done` means);
    cand    "token", "child", "lo", "edge", "ends" [n * cmax] and "count", "status" [n] (int32), "bias"
            [n * cmax] (float32);
    logits  float32 [n * cmax], the sparse head's logits of the candidates;
    picks   "done", "token", "edge" (int32 [n]) and "logprob" (float64 [n])."""
    shared = dict(cand_token=cand["token"], cand_child=cand["child"], cand_lo=cand["lo"], cand_edge=cand["edge"],
                  cand_ends=cand["ends"], cand_bias=cand["bias"], ncand=cand["count"], cmax=cmax,
                  status=cand["status"], node=rows["node"], emitted=rows["emitted"], kstride=kstride,
                  n_emitted=rows["n_emitted"])
    mask = Launch(kernels.mask, THREADS, 0,
                  dict(shared, arena=arena, row_base=rows["base"], row_const=rows["const"], k=rows["k"], allow=allow,
                       allow_start=rows["allow_start"], allow_len=rows["allow_len"], prior=prior,
                       row_prior=rows["prior"], forced=int(forced)), stream)
    select = Launch(kernels.select, THREADS, 0,
                    dict(shared, logits=logits, logit_stride=cmax, done=picks["done"], out_token=picks["token"],
                         out_edge=picks["edge"], out_logprob=picks["logprob"]), stream)
    return mask, select


class ConstantTrie:
    """Which catalog version k_mask's constant memory holds; `bind` rewrites it from the host in stream
    order. Whoever replays a captured graph that reads it must bind first: graph replay replays kernels, not
    the host upload that filled the symbol (docs/gpu.md#cuda-graphs-from-numba-launches)."""

    def __init__(self, kernels: TrieKernels):
        self.kernels = kernels
        self.owner = None

    def bind(self, owner, packed: np.ndarray, stream) -> None:
        """Make packed (owned by `owner`, e.g. a catalog's (name, version)) the resident trie, in the
        order of `stream` (the backend's Stream)."""
        if not fits_constant_memory(packed):
            raise ValueError(f"a packed trie of {packed.nbytes} bytes does not fit 64 KiB of constant memory")
        if SIM:
            CONST_TRIE[:len(packed)] = packed
        else:
            from cuda.bindings import driver
            # numba-private: the compiled module's symbol for the const array (docs/gpu.md#constant-memory),
            # in one place
            pointer, size = self.kernels.mask.module.get_global_symbol("_cudapy_cmem")
            host = cuda.pinned_array(CONST_WORDS, np.int32)  # a fresh buffer: the copy is asynchronous
            host[:] = 0
            host[:len(packed)] = packed
            check(driver.cuMemcpyHtoDAsync(int(pointer.device_ctypes_pointer.value), host.ctypes.data, size,
                                           stream.handle), "bind the constant trie")
            self._keepalive = host
        self.owner = owner


class DeviceTrie:
    """The bound catalog versions' tries on the device and the pick that reads them (for one sampler, on the
    model's stream, around its sparse head): every bound version's packed trie in one global arena, the
    newest default that fits 64 KiB also in constant memory, where its rows read it.

    `bind` makes a version resident: the engine calls it at the version switch, never inside a step. A bind
    that moves a version (a new arena, another owner of constant memory) starts a new `epoch`: rows staged
    before it are staged again before their next pick (the sampler steps ahead only within an epoch).
    A step: `stage(rows)` (one pinned buffer, one copy in), `enqueue(n)` (k_mask, the sparse head, k_select,
    one copy out into one of two host buffers), `read(buffer, n)` (waits for that copy)."""

    FIELDS = ("base", "const", "node", "n_emitted", "k", "allow_start", "allow_len", "prior")  # int32 per row

    def __init__(self, *, stream, cand, ncand, sparse, launch_sparse, rows: int, cmax: int, max_k: int,
                 max_allow: int, finish_forced: bool):
        """cand int32 [rows * cmax], ncand int32 [rows]: the sparse head's inputs, which k_mask writes;
        sparse float32 [rows * cmax]: its logits, which k_select reads; launch_sparse(n): the head over n rows.
        finish_forced: the engine's setting (what the done flags say)."""
        self.stream, self.launch_sparse = stream, launch_sparse
        self.rows, self.cmax, self.max_k, self.max_allow = rows, cmax, max_k, max_allow
        self.kernels = TrieKernels.get()
        self.constant = ConstantTrie(self.kernels)
        self.packed: dict = {}   # catalog key -> packed trie
        self.base: dict = {}     # catalog key -> offset in the arena
        self.arena = self._retired = None
        self.epoch = 0           # placements so far (bind)
        self.uploads = 0         # arena uploads so far
        n, c = rows, cmax
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
            cand={"token": cand, "count": ncand, "status": status,
                  **{key: cuda.device_array(n * c, np.int32) for key in ("child", "lo", "edge", "ends")},
                  "bias": cuda.device_array(n * c, np.float32)},
            cmax=c, logits=sparse, picks={"done": self.done, "token": token, "edge": edge,
                                          "logprob": self.dev_logprob})
        self.launch_mask = self.launch_select = None

    # ---- residency
    def holds(self, key) -> bool:
        """Is the version bound (its trie in the arena)?"""
        return key in self.packed

    def bind(self, key, trie: Trie, constant: bool = True) -> None:
        """Make a version resident: its packed trie in the arena (once; the arena is uploaded again and the
        launches repacked), and with `constant` in constant memory where it fits."""
        moved = False
        if key not in self.packed:
            self.packed[key] = pack_trie(trie)
            self._upload()
            moved = True
        if constant and self.constant.owner != key and fits_constant_memory(self.packed[key]):
            self.constant.bind(key, self.packed[key], self.stream)
            moved = True
        self.epoch += moved

    def release(self, key) -> None:
        """A released version leaves the arena at the next upload (constant memory keeps it until another
        version is bound: nothing reads it once no row names it)."""
        self.packed.pop(key, None)

    def _upload(self) -> None:
        self.base, offset = {}, 0
        for k, p in self.packed.items():
            self.base[k] = offset
            offset += len(p)
        # the arena before stays alive one upload longer: a step enqueued before this bind may still read it
        self._retired, self.arena = self.arena, cuda.to_device(np.concatenate(list(self.packed.values())))
        self.launch_mask, self.launch_select = sampler_launches(self.kernels, self.stream.handle, self.arena,
                                                                **self._buffers)
        self.uploads += 1

    # ---- a step
    def stage(self, seqs) -> None:
        """Copy the rows' trie state in (asynchronous). A row is the engine's Sequence: catalog.key (a bound
        version), node, n_emitted, emitted, k, allow (sorted pointer ids) unless allow_all, and prior (float32
        beside allow) or None."""
        f, offset = self.host_fields, 0
        for i, seq in enumerate(seqs):
            key = seq.catalog.key
            resident = self.constant.owner == key
            f["base"][i] = 0 if resident else self.base[key]
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
        self.stream.h2d(self.dev_in, self.host_in, self._o_allow + offset)
        if any(seq.prior is not None for seq in seqs):
            self.stream.h2d(self.dev_in[self._o_prior:], self.host_in[self._o_prior:], offset)

    def enqueue(self, n: int) -> int:
        """k_mask, the sparse head and k_select for rows 0..n-1 (from the state staged, or left on the device
        by the k_select before), then their copy out into the host buffers not used by the step before (a step
        may be enqueued while the host still reads the previous one); which buffer that is."""
        b = self._next_out
        self._next_out ^= 1
        self.launch_mask.launch(n)
        self.launch_sparse(n)
        self.launch_select.launch(n)
        self.stream.d2h(self.host_out[b], self.dev_out, len(self.host_out[b]))
        self.stream.d2h(self.host_logprob[b], self.dev_logprob, n)
        self.stream.record(self.out_ready[b])
        return b

    def read(self, buffer: int, n: int) -> tuple:
        """Wait for an enqueued step's copy out: per row (ok: whether it has a pick, token, edge, logprob)."""
        event_wait_host(self.out_ready[buffer])
        out, rows = self.host_out[buffer], self.rows
        status, token, edge = (out[i * rows:i * rows + n] for i in range(3))
        return status == OK, token, edge, self.host_logprob[buffer]

    def picked_tokens(self):
        """The device buffer of the last enqueued picks' tokens (row i: row i's; token 0 where a row had no
        candidate, a valid id), for the next step's forward."""
        return self.dev_token

    def done_flags(self):
        """The device buffer of whether each row's answer ended at the last enqueued picks."""
        return self.done

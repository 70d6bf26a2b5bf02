"""The trie-masked sampler on the GPU: two kernels around the model's sparse head, one block per row.

  k_mask   reads the row's current node from the trie (constant memory when the row's catalog version
           is the resident one, else the global trie arena), keeps the legal edges (sampler.py's rule)
           in edge order and writes them as the row's candidates;
  (the model's sparse head computes the candidates' logits)
  k_select takes the argmax over the candidates' logits (fixed reduction tree, lower token id on a
           tie), the log-softmax over them, and advances the row: node, emitted pointers, done.

A packed trie is one int32 array: [nodes + 1, edges, node_edge_start..., edge_token..., edge_child...,
edge_lo..., edge_hi...]. Constant memory holds one packed trie (64 KiB); `ConstantTrie.bind` rewrites
it from the host (in stream order), and whoever replays a captured graph that reads it must bind
first: graph replay replays kernels, not the host upload that filled the symbol.
"""
from __future__ import annotations

import math

import numba
import numpy as np

from decoder_service.model.cuda import compat  # noqa: F401 - numpy 2.5 fix before any kernel compiles
from numba import cuda  # noqa: E402

from shared.trie import SEP, STOP, Trie

SIM = bool(getattr(numba.config, "ENABLE_CUDASIM", 0))
THREADS = 8 if SIM else 128
CONST_WORDS = 16384                        # 64 KiB of int32
# The kernel's constant-memory image, rewritten by ConstantTrie.bind. Its initial content is never read,
# but it must not be uniform: a load from a constant array that is all zeros is folded to 0 by the
# compiler, whatever the index, and the rebinding would be silently ignored (seen on the H200).
CONST_TRIE = np.arange(CONST_WORDS, dtype=np.int32)
OK, EMPTY_MASK, TOO_MANY = 0, 1, 2         # per-row status written by k_mask
_I1, _I2 = numba.int32[::1], numba.int32[:, ::1]
MASK_SIGNATURE = (_I1,) * 4 + (_I2,) + (_I1,) * 10 + (numba.int64, _I1)


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
def _legal(cmem, arena, use_const, base, e, tok_off, n_emitted, k, emitted, r, allow, a0, alen):
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
        p = emitted[r, i]
        if lo <= p and p < hi:
            count -= 1
    return count > 0


@cuda.jit(cache=not SIM)
def k_mask(arena, row_base, row_const, node, emitted, n_emitted, k, allow, allow_start, allow_len,
           cand_token, cand_child, cand_lo, cand_edge, ncand, cmax, status):
    """One block per row: the row's legal edges, in edge order, as its candidates."""
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
    ne, kk, a0, alen = n_emitted[r], k[r], allow_start[r], allow_len[r]
    c = 0
    for e in range(lo_e, hi_e):
        if _legal(cmem, arena, use_const, base, e, tok_off, ne, kk, emitted, r, allow, a0, alen):
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
        if _legal(cmem, arena, use_const, base, e, tok_off, ne, kk, emitted, r, allow, a0, alen):
            if out < cmax:
                j = r * cmax + out
                cand_token[j] = _rd(cmem, arena, use_const, base, tok_off + e)
                cand_child[j] = _rd(cmem, arena, use_const, base, tok_off + E + e)
                cand_lo[j] = _rd(cmem, arena, use_const, base, tok_off + 2 * E + e)
                cand_edge[j] = e
            out += 1


@cuda.jit(device=True, inline="always")
def _better(v, t, bv, bt):
    """Is (v, token t) a better winner than (bv, bt)? Higher logit; the lower token id on a tie."""
    return v > bv or (v == bv and t < bt)


@cuda.jit(cache=not SIM)
def k_select(logits, logit_stride, cand_token, cand_child, cand_lo, cand_edge, ncand, cmax, status, node,
             emitted, n_emitted, done, out_token, out_edge, out_logprob):
    """One block per row: masked argmax, log-softmax over the candidates, and the trie advance."""
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
        if _better(v, t, v_best, t_best):
            v_best, t_best, i_best = v, t, i
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
        if w < 0:  # no candidate: k_mask's status says why; the row does not move
            out_token[r] = -1
            out_edge[r] = -1
            return
        j = r * cmax + w
        child = cand_child[j]
        out_token[r] = cand_token[j]
        out_edge[r] = cand_edge[j]
        out_logprob[r] = numba.float64(bv[0]) - (sm[0] + math.log(ss[0]))
        if child == SEP or child == STOP:
            emitted[r, n_emitted[r]] = cand_lo[j]
            n_emitted[r] += 1
            node[r] = 0
            if child == STOP:
                done[r] = 1
        else:
            node[r] = child


class ConstantTrie:
    """Residency of one catalog version in k_mask's constant memory, re-bound on every switch."""

    def __init__(self):
        self.owner = None
        self._symbol = None

    def _device_symbol(self):
        """(device address, size) of k_mask's constant-memory image: numba-private, kept in one place."""
        if self._symbol is None:
            if not k_mask.overloads:
                k_mask.compile(MASK_SIGNATURE)
            overload = next(iter(k_mask.overloads.values()))
            module = overload._codelibrary.get_cufunc().module
            self._symbol = module.get_global_symbol("_cudapy_cmem")
        return self._symbol

    def bind(self, owner, packed: np.ndarray, stream=0) -> None:
        """Make packed (owned by `owner`, e.g. a catalog's (name, version)) the resident trie."""
        if not fits_constant_memory(packed):
            raise ValueError(f"a packed trie of {len(packed) * 4} bytes does not fit 64 KiB of constant memory")
        if SIM:
            CONST_TRIE[:len(packed)] = packed
        else:
            from cuda.bindings import driver
            pointer, size = self._device_symbol()
            host = cuda.pinned_array(CONST_WORDS, np.int32)
            host[:] = 0
            host[:len(packed)] = packed
            handle = int(stream.handle) if hasattr(stream, "handle") else int(stream)
            (err,) = driver.cuMemcpyHtoDAsync(int(pointer.device_ctypes_pointer.value), host.ctypes.data, size,
                                              driver.CUstream(handle))
            if err != driver.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"binding the constant trie failed: {err}")
            self._keepalive = host  # the copy is asynchronous: the source must outlive it
        self.owner = owner


class DeviceSampler:
    """The engine's sampler on a GPU backend: k_mask -> the backend's sparse head -> k_select.

    The rows' trie state stays on the host (the engine's source of truth); each step uploads it, runs
    the three launches on the backend's stream, and reads back one Pick per row. Every loaded catalog
    version has its packed trie in one global arena; the newest version that fits 64 KiB is resident
    in constant memory and its rows read from there. A step the kernels cannot take whole (a node
    wider than the backend's candidate buffer, or a k past the emitted buffer) goes to the host
    sampler, which tiles: no candidate is ever dropped.
    """

    def __init__(self, backend, fallback, max_k: int = 64):
        self.be, self.fallback, self.max_k = backend, fallback, max_k
        self.stream = backend.stream.numba if not SIM else 0
        self.constant = ConstantTrie()
        self.packed: dict = {}          # catalog key -> packed trie
        self.base: dict = {}            # catalog key -> offset in the arena
        self.arena = None
        n, c = backend.max_logit_rows, backend.max_candidates
        zeros = lambda size, dt=np.int32: cuda.to_device(np.zeros(size, dt))  # noqa: E731
        self.rows = {name: zeros(n) for name in ("base", "const", "node", "n_emitted", "k", "allow_start",
                                                 "allow_len", "status", "done", "token", "edge")}
        self.emitted = cuda.to_device(np.full((n, max_k), -1, np.int32))
        self.logprob = zeros(n, np.float64)
        self.cand = {name: zeros(n * c) for name in ("child", "lo", "edge")}
        self.allow = zeros(1)

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
        if fits_constant_memory(self.packed[key]):
            self.constant.bind(key, self.packed[key], stream=self.stream)

    def forget(self, catalog) -> None:
        """A released version leaves the arena at the next registration (and constant memory keeps it
        until another version is bound: nothing reads it once no row names it)."""
        self.packed.pop(catalog.key, None)

    def choose(self, seqs) -> list:
        from decoder_service.engine.sampler import Pick, empty_mask_message
        n, cmax = len(seqs), self.be.max_candidates
        too_wide = any(s.catalog.trie.max_fanout() > cmax or s.k > self.max_k for s in seqs)
        if too_wide or n > self.be.max_logit_rows:
            return self.fallback.choose(seqs)
        for seq in seqs:
            self._register(seq.catalog)
        emitted = np.full((n, self.max_k), -1, np.int32)
        allow_parts, starts, lens = [], [], []
        offset = 0
        for i, seq in enumerate(seqs):
            emitted[i, :seq.n_emitted] = seq.emitted[:seq.n_emitted]
            starts.append(offset)
            lens.append(-1 if seq.allow_all else len(seq.allow))
            if not seq.allow_all:
                allow_parts.append(seq.allow)
                offset += len(seq.allow)
        host = {"base": [0 if self._resident(s) else self.base[s.catalog.key] for s in seqs],
                "const": [int(self._resident(s)) for s in seqs], "node": [s.node for s in seqs],
                "n_emitted": [s.n_emitted for s in seqs], "k": [s.k for s in seqs],
                "allow_start": starts, "allow_len": lens}
        st = self.stream
        for name, values in host.items():
            self.rows[name][:n].copy_to_device(np.asarray(values, np.int32), stream=st)
        self.emitted[:n].copy_to_device(emitted, stream=st)
        if offset:
            allow = np.concatenate(allow_parts).astype(np.int32)
            if len(allow) > len(self.allow):
                self.allow = cuda.to_device(allow)
            else:
                self.allow[:len(allow)].copy_to_device(allow, stream=st)
        r, c = self.rows, self.cand
        k_mask[n, THREADS, st](self.arena, r["base"], r["const"], r["node"], self.emitted, r["n_emitted"], r["k"],
                               self.allow, r["allow_start"], r["allow_len"], self.be.cand, c["child"], c["lo"],
                               c["edge"], self.be.ncand, cmax, r["status"])
        self.be.launch_sparse(n)
        k_select[n, THREADS, st](self.be.sparse, cmax, self.be.cand, c["child"], c["lo"], c["edge"], self.be.ncand,
                                 cmax, r["status"], r["node"], self.emitted, r["n_emitted"], r["done"], r["token"],
                                 r["edge"], self.logprob)
        status = r["status"][:n].copy_to_host(stream=st)
        edges = r["edge"][:n].copy_to_host(stream=st)
        tokens = r["token"][:n].copy_to_host(stream=st)
        logprobs = self.logprob[:n].copy_to_host(stream=st)
        if not SIM:
            st.synchronize()
        return [Pick(int(edges[i]), int(tokens[i]), float(logprobs[i])) if status[i] == OK
                else empty_mask_message(seq) for i, seq in enumerate(seqs)]

    def _resident(self, seq) -> bool:
        return self.constant.owner == seq.catalog.key

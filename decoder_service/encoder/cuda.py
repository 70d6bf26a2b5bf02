"""The CUDA encoder: numba.cuda kernels for the BERT forward pass, launched through decoder_service.gpu.

Texts packed end to end, float16 weights, float32 sums; a few texts (a request's parts) replay a graph captured
for their row count rounded up to GRAPH_ROWS (the spare rows a text of their own) and text count. Every GEMM
output is one fixed arithmetic whatever the rows around it (k_gemm: K in SEG segments, fixed order), so a text's
vector is bit-identical alone or in any batch (docs/encoder.md, "The CUDA pass").
"""
from __future__ import annotations

import ctypes
import functools
import math
import threading
from collections import OrderedDict

import numpy as np

from shared.errors import ModelError
from decoder_service.gpu import compat  # noqa: F401  (numpy's row_stack alias before numba-cuda compiles)
from decoder_service.gpu.intrinsics import SIM, WARP, block_max, block_sum, dot8, ld8, ldf, pdl_enter, prefetch_l2
from decoder_service.gpu.launcher import Graph, Kernel, Launch, Scalar, Stream

from numba import cuda
from numba import float32 as nb_f32

from .config import MAX_TOKENS, EncoderConfig
from .packing import chunks
from .turns import Turns
from .weights import EncoderWeights

# Under the simulator (one Python thread per CUDA thread) every block is a few threads wide, so the
# multi-thread and multi-warp paths still run on tiny models.
SEG = 8 if SIM else 32            # K segment: one fma chain (see the module docstring)
RS = 2                            # k_gemm: rows per thread and per block (the kernel's p0 and p1)
SEG_THREADS = 16 if SIM else 256  # k_gemm: most threads a block (one segment of K and 8 columns each)
SEG_SUMS = RS * 8 * SEG_THREADS   # k_gemm: the segment sums in shared memory (a block's RS x 8 per thread)
ROW_THREADS = 2 * WARP if SIM else 128   # LayerNorm, embedding and pooling blocks
ATTN_THREADS = WARP               # attention: one warp per (row, head)
MAX_H = 1024                      # hidden size bound (a row staged in shared memory)
CHUNK_TOKENS = 16384              # token rows per forward pass (activations ~ 15 KB a row)
GRAPHS = 64                       # captured graphs kept (one per padded row count and text count)
GRAPH_ROWS = 4 if SIM else 16     # a graph's rows: the texts' tokens rounded up to a multiple of this
GRAPH_TEXTS = 8                   # most texts a graph runs (a request's parts: retrieval.config.MAX_PARTS)

MODE_PLAIN, MODE_GELU, MODE_RESIDUAL = 0, 1, 2


@cuda.jit(device=True, inline="always")
def epilogue(v, res, idx, mode):
    """A GEMM output after its bias: as is, GELU (exact erf form), or plus the residual res[idx]."""
    if mode == MODE_GELU:
        return nb_f32(0.5) * v * (nb_f32(1.0) + math.erf(v * nb_f32(0.7071067811865476)))
    if mode == MODE_RESIDUAL:
        return v + res[idx]
    return v


@cuda.jit(device=True, inline="always")
def fma8(x, w, p):
    """p[j] + x * w[j] for the 8 columns of a 16-byte weight load (fma, one rounding each)."""
    return (cuda.fma(x, w[0], p[0]), cuda.fma(x, w[1], p[1]), cuda.fma(x, w[2], p[2]), cuda.fma(x, w[3], p[3]),
            cuda.fma(x, w[4], p[4]), cuda.fma(x, w[5], p[5]), cuda.fma(x, w[6], p[6]), cuda.fma(x, w[7], p[7]))


@cuda.jit(device=True, inline="always")
def fma64(x, v0, v1, v2, v3, v4, v5, v6, v7, p):
    """p after 8 ks in ascending order: x the row's 8 activations, v0..v7 the 8 weights of each k (fma8 each)."""
    p = fma8(x[0], v0, p)
    p = fma8(x[1], v1, p)
    p = fma8(x[2], v2, p)
    p = fma8(x[3], v3, p)
    p = fma8(x[4], v4, p)
    p = fma8(x[5], v5, p)
    p = fma8(x[6], v6, p)
    return fma8(x[7], v7, p)


@cuda.jit(device=True, inline="always")
def st8(arr, i, p):
    """arr[i:i + 8] = p."""
    for j in range(8):
        arr[i + j] = p[j]


@cuda.jit(device=True, inline="always")
def hint_l2(arr, start, n, tid, T):
    """Cache hint for arr[start:start + n] into L2, a line (32 words) a thread: for weights, before the PDL wait."""
    for i in range(start + tid * 32, start + n, T * 32):
        prefetch_l2(arr, i)


@cuda.jit(cache=True)
def k_gemm(a, W, bias, res, out, M, K, N, mode):
    """out[M, N] = epilogue(a[M, K] @ W[K, N] + bias): thread (s, g) sums segment s of RS rows x 8 columns, each
    output from zero in ascending k with fma (16-byte loads: a k's 8 weights, shared by the rows, and a row's 8
    activations); then the block adds each output's segment sums in ascending order, the bias, the epilogue. A
    thread has one segment, so a few rows still fill the GPU; an output's arithmetic never depends on M.
    Grid (N / (8 G), ceil(M / RS)), block K / SEG * G. The weights and bias are hinted into L2 before the PDL wait
    (no kernel writes them), so that their loads after it are L2 hits."""
    tid = cuda.threadIdx.x
    nseg = K // SEG
    groups = cuda.blockDim.x // nseg
    g, s = tid % groups, tid // groups
    cols = 8 * groups
    n0, m0 = cuda.blockIdx.x * cols, cuda.blockIdx.y * RS
    w0 = s * SEG * N + n0 + 8 * g
    if cuda.blockIdx.y == 0:     # the blocks of one column slice read the same weights: one hints them
        for k in range(SEG):
            prefetch_l2(W, w0 + k * N)
        hint_l2(bias, n0, cols, tid, cuda.blockDim.x)
    pdl_enter()
    sums = cuda.shared.array(SEG_SUMS, nb_f32)   # [segment][row][column]
    r0, r1 = min(m0, M - 1) * K + s * SEG, min(m0 + 1, M - 1) * K + s * SEG
    z = nb_f32(0)
    p0 = p1 = (z, z, z, z, z, z, z, z)
    for k in range(0, SEG, 8):     # 8 weight loads and the rows' 8 activations in flight together
        wk = w0 + k * N
        v0, v1, v2, v3 = ld8(W, wk), ld8(W, wk + N), ld8(W, wk + 2 * N), ld8(W, wk + 3 * N)
        v4, v5, v6, v7 = ld8(W, wk + 4 * N), ld8(W, wk + 5 * N), ld8(W, wk + 6 * N), ld8(W, wk + 7 * N)
        p0 = fma64(ld8(a, r0 + k), v0, v1, v2, v3, v4, v5, v6, v7, p0)
        p1 = fma64(ld8(a, r1 + k), v0, v1, v2, v3, v4, v5, v6, v7, p1)
    st8(sums, s * RS * cols + 8 * g, p0)
    st8(sums, (s * RS + 1) * cols + 8 * g, p1)
    cuda.syncthreads()
    for e in range(tid, RS * cols, cuda.blockDim.x):
        i, c = e // cols, e % cols
        m = m0 + i
        if m < M:
            acc = nb_f32(0)
            for t in range(nseg):
                acc += sums[(t * RS + i) * cols + c]
            n = n0 + c
            idx = m * N + n
            out[idx] = epilogue(acc + bias[n], res, idx, mode)


def seg_groups(K: int, N: int) -> int:
    """k_gemm's column groups a block for K x N: the most that divide N / 8 and keep the block within
    SEG_THREADS threads (one segment a thread), at least one."""
    nseg = K // SEG
    return max(g for g in range(1, N // 8 + 1) if (N // 8) % g == 0 and nseg * g <= SEG_THREADS)


@cuda.jit(device=True, inline="always")
def layer_norm_staged(xs, s, H, gamma, beta, eps, out, base, tid, T, red):
    """out[base + c] = LayerNorm of the row whose values this thread staged in xs[c] (c = tid, tid + T,
    ...) and summed into s; fixed trees, the same for every row."""
    nw = T // WARP
    mean = block_sum(s, red, tid, nw) / nb_f32(H)
    q = nb_f32(0)
    for c in range(tid, H, T):
        d = xs[c] - mean
        q += d * d
    var = block_sum(q, red, tid, nw) / nb_f32(H)
    inv = nb_f32(1.0) / math.sqrt(var + eps)
    for c in range(tid, H, T):
        out[base + c] = (xs[c] - mean) * inv * gamma[c] + beta[c]


@cuda.jit(cache=True)
def k_embed(meta, M, word, pos, type0, gamma, beta, eps, H, out):
    """out[row] = LayerNorm(word[id] + pos[position in its text] + type0). Grid M."""
    row, tid, T = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
    hint_l2(gamma, 0, H, tid, T)
    hint_l2(beta, 0, H, tid, T)
    hint_l2(type0, 0, H, tid, T)
    pdl_enter()
    xs = cuda.shared.array(MAX_H, nb_f32)
    red = cuda.shared.array(32, nb_f32)
    tok = meta[row]
    p = row - meta[2 * M + 2 * meta[M + row]]
    s = nb_f32(0)
    for c in range(tid, H, T):
        v = ldf(word, tok * H + c) + ldf(pos, p * H + c) + type0[c]
        xs[c] = v
        s += v
    layer_norm_staged(xs, s, H, gamma, beta, eps, out, row * H, tid, T, red)


@cuda.jit(cache=True)
def k_layernorm(x, gamma, beta, eps, H, out):
    """out[row] = LayerNorm(x[row]). Grid M."""
    row, tid, T = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
    hint_l2(gamma, 0, H, tid, T)
    hint_l2(beta, 0, H, tid, T)
    pdl_enter()
    xs = cuda.shared.array(MAX_H, nb_f32)
    red = cuda.shared.array(32, nb_f32)
    s = nb_f32(0)
    for c in range(tid, H, T):
        v = x[row * H + c]
        xs[c] = v
        s += v
    layer_norm_staged(xs, s, H, gamma, beta, eps, out, row * H, tid, T, red)


@cuda.jit(cache=True)
def k_attention(qkv, meta, M, nh, hd, scale, out):
    """Bidirectional attention of one row and one head over its own text's rows (keys ascending).
    qkv rows are query | key | value, heads contiguous (hd a multiple of 8: 16-byte loads of q and k).
    Grid (M, nh), block one warp."""
    pdl_enter()
    sc = cuda.shared.array(MAX_TOKENS, nb_f32)
    red = cuda.shared.array(32, nb_f32)
    row, h, tid, T = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x, cuda.blockDim.x
    t = meta[M + row]
    s0, L = meta[2 * M + 2 * t], meta[2 * M + 2 * t + 1]
    H = nh * hd
    qb = row * 3 * H + h * hd
    mx = nb_f32(-math.inf)
    for j in range(tid, L, T):
        kb = (s0 + j) * 3 * H + H + h * hd
        s = nb_f32(0)
        for d in range(0, hd, 8):
            s = dot8(ld8(qkv, qb + d), ld8(qkv, kb + d), s)
        s *= scale
        sc[j] = s
        mx = max(mx, s)
    mx = block_max(mx, red, tid, T // WARP)
    total = nb_f32(0)
    for j in range(tid, L, T):
        e = math.exp(sc[j] - mx)
        sc[j] = e
        total += e
    total = block_sum(total, red, tid, T // WARP)     # its barrier also publishes sc
    step = 3 * H
    for d in range(tid, hd, T):
        acc = nb_f32(0)
        vb = s0 * step + 2 * H + h * hd + d
        j = 0
        while j + 4 <= L:        # four values' loads in flight, added in the same order
            v0, v1, v2, v3 = qkv[vb + j * step], qkv[vb + (j + 1) * step], qkv[vb + (j + 2) * step], \
                qkv[vb + (j + 3) * step]
            acc = cuda.fma(sc[j], v0, acc)
            acc = cuda.fma(sc[j + 1], v1, acc)
            acc = cuda.fma(sc[j + 2], v2, acc)
            acc = cuda.fma(sc[j + 3], v3, acc)
            j += 4
        while j < L:
            acc = cuda.fma(sc[j], qkv[vb + j * step], acc)
            j += 1
        out[row * H + h * hd + d] = acc / total


@cuda.jit(cache=True)
def k_pool(x, meta, M, H, out):
    """out[t] = mean of text t's rows (ascending), divided by its L2 norm (at least 1e-12). Grid texts."""
    pdl_enter()
    xs = cuda.shared.array(MAX_H, nb_f32)
    red = cuda.shared.array(32, nb_f32)
    t, tid, T = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
    s0, L = meta[2 * M + 2 * t], meta[2 * M + 2 * t + 1]
    q = nb_f32(0)
    for c in range(tid, H, T):
        acc = nb_f32(0)
        for r in range(L):
            acc += x[(s0 + r) * H + c]
        v = acc / nb_f32(L)
        xs[c] = v
        q += v * v
    norm = max(math.sqrt(block_sum(q, red, tid, T // WARP)), nb_f32(1e-12))
    for c in range(tid, H, T):
        out[t * H + c] = xs[c] / norm


def _signatures() -> dict:
    from numba.cuda import types as t
    f32, i32, W = t.Array(t.float32, 1, "C"), t.int32, t.Array(t.float16, 1, "C")
    ai = t.Array(t.int32, 1, "C")
    gemm = (f32, W, f32, f32, f32, i32, i32, i32, i32)
    kernels = {k_gemm: gemm,
               k_embed: (ai, i32, W, W, f32, f32, f32, t.float32, i32, f32),
               k_layernorm: (f32, f32, f32, t.float32, i32, f32),
               k_attention: (f32, ai, i32, i32, i32, t.float32, f32),
               k_pool: (f32, ai, i32, i32, f32)}
    # prefixed: TOOLTRIE_CARVEOUT names kernels, and the generator has a k_embed and a k_gemm too
    return {f"encoder.{k.py_func.__name__}": (k, argtypes) for k, argtypes in kernels.items()}


def stored_weights(w: EncoderWeights) -> EncoderWeights:
    """The weights as this backend holds them (matrices and embedding tables rounded to float16), for
    checking it against the float64 reference on the same values."""
    half = {"word", "position", "wqkv", "wo", "w1", "w2"}
    return EncoderWeights(**{k: (v.astype(np.float16).astype(np.float32) if k in half else v)
                             for k, v in vars(w).items()})


class CudaEncoder:
    """embed(token id arrays) -> [n, H] float32 unit vectors, on the GPU (or numba's simulator)."""

    def __init__(self, cfg: EncoderConfig, weights: EncoderWeights, chunk_tokens: int = CHUNK_TOKENS,
                 graphs: int = GRAPHS):
        H, I = cfg.hidden_size, cfg.intermediate_size
        for what, k in (("hidden_size", H), ("intermediate_size", I)):
            if k % SEG or k // SEG > SEG_THREADS:
                raise ModelError(f"cuda encoder: {what} {k} must be a multiple of {SEG} and at most "
                                 f"{SEG_THREADS * SEG}")
        if cfg.head_dim % 8:
            raise ModelError(f"cuda encoder: head_dim {cfg.head_dim} must be a multiple of 8")
        if H > MAX_H or chunk_tokens < cfg.max_seq_length:
            raise ModelError(f"cuda encoder: hidden_size {H} > {MAX_H} or chunk_tokens {chunk_tokens} < "
                             f"max_seq_length {cfg.max_seq_length}")
        self.cfg, self.chunk_tokens, self.max_graphs = cfg, chunk_tokens, graphs
        self.turns = Turns()       # the staging buffers, the stream and the graphs are one caller's at a time
        self._threads = set()
        self.stream = Stream()
        R = B = chunk_tokens
        dev = cuda.to_device

        def f16(a):
            return dev(np.ascontiguousarray(a, np.float16).reshape(-1))

        def f32(a):
            return dev(np.ascontiguousarray(a, np.float32).reshape(-1))

        def t(a):
            return a.transpose(0, 2, 1)   # [L, N, K] -> [L, K, N]

        self.word, self.pos, self.type0 = f16(weights.word), f16(weights.position), f32(weights.token_type)
        self.emb_norm = f32(weights.emb_norm_w), f32(weights.emb_norm_b)
        mats = {"qkv": (t(weights.wqkv), weights.bqkv), "o": (t(weights.wo), weights.bo),
                "w1": (t(weights.w1), weights.b1), "w2": (t(weights.w2), weights.b2)}
        self.mats = {k: (f16(w), f32(b)) for k, (w, b) in mats.items()}
        self.norms = {"attn": (f32(weights.attn_norm_w), f32(weights.attn_norm_b)),
                      "ffn": (f32(weights.ffn_norm_w), f32(weights.ffn_norm_b))}
        self.x, self.y = cuda.device_array(R * H, np.float32), cuda.device_array(R * H, np.float32)
        self.ctx = cuda.device_array(R * H, np.float32)
        self.qkv = cuda.device_array(R * 3 * H, np.float32)
        self.inter = cuda.device_array(R * I, np.float32)
        self.meta = cuda.device_array(2 * R + 2 * B + 2, np.int32)   # ids | row -> text | (start, len) a text
        self.emb = cuda.device_array(B * H, np.float32)
        pin = np.zeros if SIM else cuda.pinned_array
        self.meta_host, self.emb_host = pin(2 * R + 2 * B + 2, np.int32), pin(B * H, np.float32)
        self.rows = Scalar(ctypes.c_int32)            # M: the chunk's token rows
        self.graphs: OrderedDict[tuple[int, int], Graph] = OrderedDict()
        self._build_launches()

    def _build_launches(self) -> None:
        cfg, st = self.cfg, self.stream.handle
        H, I, nh, eps = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.layer_norm_eps
        k = {name: Kernel(name, f, a, pdl=True) for name, (f, a) in _signatures().items()}
        M = self.rows
        gamma, beta = self.emb_norm
        self.l_embed = Launch(k["encoder.k_embed"], ROW_THREADS, 0,
                              dict(meta=self.meta, M=M, word=self.word, pos=self.pos, type0=self.type0, gamma=gamma,
                                   beta=beta, eps=eps, H=H, out=self.x), st)
        self.l_pool = Launch(k["encoder.k_pool"], ROW_THREADS, 0,
                             dict(x=self.x, meta=self.meta, M=M, H=H, out=self.emb), st)
        self.layers = []      # a layer's launches as (name, launch, grid for M rows)
        for layer in range(cfg.num_layers):
            def gemm(name, a, out, K, N, mode, res, layer=layer):
                w, b = self.mats[name]
                args = dict(a=a, W=w[layer * K * N:(layer + 1) * K * N], bias=b[layer * N:(layer + 1) * N], res=res,
                            out=out, M=M, K=K, N=N, mode=mode)
                groups = seg_groups(K, N)
                columns = N // 8 // groups
                return name, Launch(k["encoder.k_gemm"], K // SEG * groups, 0, args, st, name), \
                    lambda m: (columns, -(-m // RS))

            def norm(name, x, out, layer=layer):
                g, b = self.norms[name]
                return f"{name} norm", Launch(k["encoder.k_layernorm"], ROW_THREADS, 0,
                                              dict(x=x, gamma=g[layer * H:(layer + 1) * H],
                                                   beta=b[layer * H:(layer + 1) * H], eps=eps, H=H, out=out), st), \
                    lambda m: (m,)

            attn = Launch(k["encoder.k_attention"], ATTN_THREADS, 0,
                          dict(qkv=self.qkv, meta=self.meta, M=M, nh=nh, hd=cfg.head_dim,
                               scale=1.0 / math.sqrt(cfg.head_dim), out=self.ctx), st)
            self.layers.append([gemm("qkv", self.x, self.qkv, H, 3 * H, MODE_PLAIN, self.x),
                                ("attention", attn, lambda m: (m, nh)),
                                gemm("o", self.ctx, self.y, H, H, MODE_RESIDUAL, self.x), norm("attn", self.y, self.x),
                                gemm("w1", self.x, self.inter, H, I, MODE_GELU, self.x),
                                gemm("w2", self.inter, self.y, I, H, MODE_RESIDUAL, self.x),
                                norm("ffn", self.y, self.x)])

    def launches(self, M: int, B: int) -> list[tuple[str, object]]:
        """The forward pass over M rows of B texts as (name, enqueue) pairs in launch order (one name a kernel
        and shape: "embed", "qkv", "attention", ...), for M set in `rows` and the inputs staged."""
        out = [("embed", lambda: self.l_embed.launch(M))]
        for ops in self.layers:
            out += [(name, functools.partial(launch.launch, *grid(M))) for name, launch, grid in ops]
        return out + [("pool", lambda: self.l_pool.launch(B))]

    def _enqueue(self, M: int, B: int) -> None:
        """Copy the staged inputs, run the forward pass over M rows of B texts (and the spare rows' text after
        them), leaving the B vectors in emb (asynchronous on the stream; capturable)."""
        self.stream.h2d(self.meta, self.meta_host, 2 * M + 2 * B + 2)
        for _, launch in self.launches(M, B):
            launch()

    def _stage(self, seqs: list[np.ndarray]) -> tuple[int, int, bool]:
        """Stage the texts' ids, row -> text map and (start, length) pairs; rows past the texts' (up to a graph's
        row count, when they run in one) are a spare text of [PAD] tokens that no vector is pooled from; `rows` is set
        to their count. Returns (rows, texts, whether a graph runs them)."""
        lens = [len(q) for q in seqs]
        if min(lens) < 1 or max(lens) > self.cfg.max_seq_length:
            raise ValueError(f"token counts must be 1..{self.cfg.max_seq_length}")
        n, B = sum(lens), len(seqs)
        if n > self.chunk_tokens:
            raise ValueError(f"{B} texts of {n} tokens do not fit one chunk of {self.chunk_tokens}")
        M = -(-n // GRAPH_ROWS) * GRAPH_ROWS
        graphed = bool(self.max_graphs) and B <= GRAPH_TEXTS and M <= self.chunk_tokens
        M = M if graphed else n
        self.rows.value = M
        m = self.meta_host
        m[:n] = np.concatenate(seqs)
        m[n:M] = 0
        pairs, at = [], 0
        for t, L in enumerate(lens):     # a few slices, not numpy's per-call setup: this is a request's latency
            m[M + at:M + at + L] = t
            pairs += (at, L)
            at += L
        m[M + n:2 * M] = B
        m[2 * M:2 * M + 2 * B + 2] = pairs + [n, M - n]
        return M, B, graphed

    def _graph(self, M: int, B: int) -> Graph:
        """The captured forward pass of M rows of B texts (least recently used ones are dropped)."""
        g = self.graphs.pop((M, B), None)
        if g is None:
            g = Graph(self.stream, lambda: self._enqueue(M, B))
            while len(self.graphs) >= self.max_graphs:
                self.graphs.popitem(last=False)
        self.graphs[M, B] = g
        return g

    def bind_thread(self) -> None:
        """Make the context current in this thread, once (the raw driver calls need it)."""
        if not SIM and threading.get_ident() not in self._threads:
            cuda.current_context()
            self._threads.add(threading.get_ident())

    def enqueue(self, seqs: list[np.ndarray]):
        """The forward pass of texts that fit one chunk enqueued on the stream (a graph's replay where they fit
        one) and not waited for: their vectors are emb[:len(seqs) * H] once it has run. Only in the caller's turn
        (`with turns:`), which it keeps until then (the device shortlist enqueues its work behind it)."""
        self.bind_thread()
        M, B, graphed = self._stage(seqs)
        if graphed:
            self._graph(M, B).replay()
        else:
            self._enqueue(M, B)
        return self.emb

    def embed(self, seqs: list[np.ndarray]) -> np.ndarray:
        H = self.cfg.hidden_size
        out = np.zeros((len(seqs), H), np.float32)
        for a, b in chunks(seqs, self.chunk_tokens):
            with self.turns:       # a chunk at a time: a request waits for one chunk of a version's vectors, not all
                self.enqueue(seqs[a:b])
                self.stream.d2h(self.emb_host, self.emb, (b - a) * H)
                self.stream.synchronize()
                out[a:b] = self.emb_host[:(b - a) * H].reshape(b - a, H)
        return out

"""What every bench command sets up the same way: the device, the model shapes with random weights, the
backend, the step batches of a cached prefix, and the CUDA-event timer."""
from __future__ import annotations

import re
import statistics
import time
from pathlib import Path

import numpy as np

from decoder_service.model.batch import StepBatch
from decoder_service.model.config import ModelConfig
from decoder_service.model.kv_pool import KVPoolSpec
from decoder_service.model.weights import Weights, f32_to_bf16
from shared.config import DEFAULT_MODEL_DIR

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
BLOCK = 16
MAX_SEQS = 256

# The two model shapes the benchmarks run (random weights at the real shapes).
MODELS = {
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": True, "hidden_act": "silu"},
    "qwen3-1.7b": {
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 40960, "tie_word_embeddings": True, "hidden_act": "silu"},
}


def device_label(kind: str) -> str:
    """The results files' device word: the GPU's model ("h100", "h200") on the cuda backend, else "cpu"."""
    if kind != "cuda":
        return "cpu"
    from decoder_service.model.backend import device_name
    found = re.search(r"\b([A-Z]\d{2,4})\b", device_name("cuda"))
    return found.group(1).lower() if found else "gpu"


def log(*a) -> None:
    print(*a, flush=True)


def ints(text: str) -> list[int]:
    """"1,16,64" -> [1, 16, 64] (empty items skipped)."""
    return [int(x) for x in text.split(",") if x]


def has_gpu() -> bool:
    try:
        from numba import cuda
        return cuda.is_available()
    except Exception:  # noqa: BLE001 - no driver, no numba-cuda: a CPU run
        return False


def shape_config(shape: str) -> ModelConfig:
    return ModelConfig.from_dict(MODELS[shape], shape)


def rand_bf16(rng, shape, scale):
    """Random bf16 bits, fast: sign, mantissa and one exponent bit from one uint16 draw; magnitudes
    in [scale/2, 2*scale). Never zeros, never denormals."""
    r = rng.integers(0, 1 << 16, size=int(np.prod(shape)), dtype=np.uint16)
    e = np.uint16(127 + int(np.floor(np.log2(scale))) - 1)
    bits = (r & np.uint16(0x807F)) | ((e + ((r >> np.uint16(7)) & np.uint16(1))) << np.uint16(7))
    return bits.reshape(shape)


def random_weights(cfg: ModelConfig, seed: int) -> Weights:
    rng = np.random.default_rng(seed)
    L, H, I, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv, d = cfg.q_size, cfg.kv_size, cfg.head_dim

    def norm(*s):
        return f32_to_bf16((1.0 + 0.1 * rng.standard_normal(s)).astype(np.float32))

    embed = rand_bf16(rng, (V, H), 1.0)
    return Weights(
        dtype="bfloat16", source_dtype="bfloat16(random)", embed=embed, lm_head=embed,
        final_norm=norm(H), attn_norm=norm(L, H),
        wqkv=rand_bf16(rng, (L, q + 2 * kv, H), 1 / np.sqrt(H)), bqkv=None,
        q_norm=norm(L, d) if cfg.qk_norm else None, k_norm=norm(L, d) if cfg.qk_norm else None,
        wo=rand_bf16(rng, (L, H, q), 1 / np.sqrt(q)), mlp_norm=norm(L, H),
        w_gate_up=rand_bf16(rng, (L, 2 * I, H), 1 / np.sqrt(H)),
        w_down=rand_bf16(rng, (L, H, I), 1 / np.sqrt(I)))


def model_for(shape: str, gpu: bool):
    """(cfg, weights, what) for a shape: the real SmolLM2 checkpoint where it exists, else random."""
    from decoder_service.model.backend import weights_dtype
    from decoder_service.model.weights import load_weights
    real = Path(DEFAULT_MODEL_DIR)
    if shape == "smollm2-135m" and (real / "model.safetensors").exists():
        cfg = ModelConfig.from_dir(real)
        return cfg, load_weights(real, cfg, weights_dtype("cuda" if gpu else "cpu", cfg), progress=False), "real"
    cfg = shape_config(shape)
    return cfg, random_weights(cfg, seed=1), "random bf16"


def make_backend(cfg, weights, spec, gpu: bool, max_table: int, **options):
    """The serving run's backend: CUDA (the served step size, MAX_SEQS logit rows, 1,024 candidates; `options` to
    its constructor) or the CPU one."""
    if gpu:
        from decoder_service.model.cuda.backend import CudaBackend
        return CudaBackend(cfg, weights, spec, **{"max_logit_rows": MAX_SEQS, "max_candidates": 1024,
                                                   "max_table": max_table, **options})
    from decoder_service.model.cpu import CpuBackend
    return CpuBackend(cfg, weights, spec)


# ------------------------------------------------------------------ a step's rows after a cached prefix
def prefill_batch(rows: int, prefix: int, per_seq: int) -> StepBatch:
    """One sequence prefilling `rows` rows at positions prefix.. after a prefix already in the pool."""
    table = np.arange(per_seq, dtype=np.int32)[None]
    return StepBatch(tokens=np.full(rows, 198, np.int32), slots=np.zeros(rows, np.int32),
                     positions=np.arange(prefix, prefix + rows, dtype=np.int32), block_tables=table,
                     logit_rows=np.array([rows - 1], np.int32))


def decode_batch(rows: int, prefix: int, per_seq: int) -> StepBatch:
    """R sequences sharing the prefix's full blocks (as requests of one catalog do), one row each."""
    shared = prefix // BLOCK
    own = prefix // BLOCK + 1 - shared
    tables = np.full((rows, per_seq), -1, np.int32)
    tables[:, :shared] = np.arange(shared)
    tables[:, shared:shared + own] = shared + np.arange(rows * own).reshape(rows, own)
    return StepBatch(tokens=np.full(rows, 198, np.int32), slots=np.arange(rows, dtype=np.int32),
                     positions=np.full(rows, prefix, np.int32), block_tables=tables,
                     logit_rows=np.arange(rows, dtype=np.int32), decode_rows=rows)


def case_batch(kind: str, rows: int, prefix: int, per_seq: int) -> StepBatch:
    return (prefill_batch if kind == "prefill" else decode_batch)(rows, prefix, per_seq)


def parse_case(text: str) -> tuple[str, int, int]:
    """A case as KIND:ROWS@PREFIX (decode:1@4955, prefill:58@4985): (kind, rows, prefix)."""
    kind, _, shape = text.partition(":")
    rows, _, prefix = shape.partition("@")
    if kind not in ("decode", "prefill") or not rows.isdigit() or not prefix.isdigit():
        raise SystemExit(f"bad case {text!r}: expected decode:R@P or prefill:R@P")
    return kind, int(rows), int(prefix)


def sized_backend(cfg: ModelConfig, max_rows: int, max_position: int, spare: int = 1, **options):
    """A CudaBackend (random bf16 weights, seed 1; `options` to its constructor) for max_rows rows of
    prefill_batch or decode_batch up to max_position, and the blocks a sequence's table spans (per_seq).
    The pool holds one sequence's blocks plus `spare` blocks a row (its size sets where random K/V land:
    the logits fingerprint keeps 2, so its hashes stay comparable across checkouts)."""
    from decoder_service.model.cuda.backend import CudaBackend
    per_seq = -(-(max_position + 1) // BLOCK)
    be = CudaBackend(cfg, random_weights(cfg, seed=1), KVPoolSpec(per_seq + spare * max_rows, BLOCK),
                     max_rows=max_rows, max_logit_rows=max_rows, max_table=per_seq * max_rows, **options)
    return be, per_seq


def relaunch(lz, kernel=None, block: int | None = None, shmem: int | None = None, **changed):
    """A backend's Launch packed again (its stream and name) on `kernel`, with `block` threads and `shmem` bytes
    of dynamic shared memory where given, the arguments named in `changed` set (k_gemv's pf, k_attn_rows'
    maxs, ...)."""
    from decoder_service.gpu.launcher import Launch
    args = dict(zip(lz.kernel.params, lz.args))
    unknown = changed.keys() - args.keys()
    if unknown:
        raise TypeError(f"{lz.kernel.name} has no parameters {sorted(unknown)}")
    return Launch(kernel or lz.kernel, block or lz.block, lz.shmem if shmem is None else shmem, {**args, **changed},
                  lz.stream, lz.name)


# ------------------------------------------------------------------------------------------ timing
class Timer:
    """Median CUDA-event time of a graph captured on a CudaBackend's stream."""

    def __init__(self, be):
        from decoder_service.gpu.launcher import new_event
        self.be = be
        self.e0, self.e1 = new_event(True), new_event(True)

    def graph_ms(self, fn, reps=15):
        """Median ms of one replay of the graph captured from fn (after two warm-up replays), and its nodes."""
        from decoder_service.gpu.launcher import event_ms
        g = self.be.capture(fn)
        for _ in range(2):
            g.replay()
        self.be.synchronize()
        ts = []
        for _ in range(reps):
            self.be.stream.record(self.e0)
            g.replay()
            self.be.stream.record(self.e1)
            self.be.synchronize()
            ts.append(event_ms(self.e0, self.e1))
        return statistics.median(ts), g.num_nodes


def copy_bandwidth(nbytes=2 << 30):
    """Device-to-device cuMemcpy: (GB/s counting bytes read + written, median ms)."""
    from cuda.bindings import driver as drv
    from numba import cuda

    from decoder_service.gpu.launcher import check, dptr, event_ms, new_event
    a = cuda.device_array(nbytes // 4, np.float32)
    b = cuda.device_array(nbytes // 4, np.float32)
    s = cuda.stream()
    h = drv.CUstream(int(s.handle))
    check(drv.cuMemsetD32Async(dptr(a), 0x3F800000, nbytes // 4, h))
    e0, e1 = new_event(True), new_event(True)
    ts = []
    for _ in range(12):
        check(drv.cuEventRecord(e0, h))
        check(drv.cuMemcpyDtoDAsync(dptr(b), dptr(a), nbytes, h))
        check(drv.cuEventRecord(e1, h))
        check(drv.cuEventSynchronize(e1))
        ts.append(event_ms(e0, e1))
    ms = statistics.median(ts[2:])
    return 2 * nbytes / (ms * 1e-3) / 1e9, ms


def host_copy_bandwidth() -> float:
    """GB/s of a 512 MiB host memcpy (read + written), the CPU run's floor."""
    a = np.ones(1 << 27, np.float32)
    b = np.empty_like(a)
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(b, a)
        ts.append(time.perf_counter() - t)
    return 2 * a.nbytes / min(ts) / 1e9

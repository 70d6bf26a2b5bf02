"""GPU timing of the sampler kernels: constant-memory trie vs global-memory trie, by batch size.

    python3 bench/gpu_sampler_bench.py     (on the GPU machine; TOOLTRIE_SHARED_DATA may point at the data)

Rows sit at the MetaTool trie's root (its widest node, the worst case for k_mask). Times are CUDA
events around 200 launches of k_mask + k_select (dispatcher launches: this measures the kernels'
GPU time, not the launch path, which the engine owns). k_mask is timed at the root every time; k_select
after it (its cost does not depend on the node).
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

from compiler_service.compiler import compile_catalog  # noqa: E402
from decoder_service.engine import cuda_sampler as cs  # noqa: E402
from numba import cuda  # noqa: E402
from shared.catalog import parse_registry  # noqa: E402
from shared.tokenizer import ModelTokenizer  # noqa: E402
from tokenizer_fixtures import catalog_path, make_tokenizer_dir  # noqa: E402


def time_kernels(trie, packed, use_const, n_rows, reps=200):
    cmax = trie.max_fanout()
    i32 = lambda a: cuda.to_device(np.ascontiguousarray(a, np.int32))  # noqa: E731
    arena = i32(packed)
    args_mask = [arena, i32(np.zeros(n_rows)), i32(np.full(n_rows, use_const)), i32(np.zeros(n_rows)),
                 cuda.to_device(np.full((n_rows, 4), -1, np.int32)), i32(np.zeros(n_rows)), i32(np.full(n_rows, 3)),
                 i32(np.zeros(1)), i32(np.zeros(n_rows)), i32(np.full(n_rows, -1))]
    cand = [i32(np.zeros(n_rows * cmax)) for _ in range(4)]
    ncand, status = i32(np.zeros(n_rows)), i32(np.zeros(n_rows))
    logits = cuda.to_device(np.random.default_rng(0).standard_normal(n_rows * cmax).astype(np.float32))
    out = [i32(np.zeros(n_rows)), i32(np.zeros(n_rows)), cuda.to_device(np.zeros(n_rows))]
    done = i32(np.zeros(n_rows))

    mask = lambda: cs.k_mask[n_rows, cs.THREADS](*args_mask, *cand, ncand, cmax, status)  # noqa: E731
    select = lambda: cs.k_select[n_rows, cs.THREADS](logits, cmax, *cand, ncand, cmax, status,  # noqa: E731
                                                     args_mask[3], args_mask[4], args_mask[5], done, *out)
    mask()
    cuda.synchronize()
    assert (status.copy_to_host() == 0).all() and (ncand.copy_to_host() == cmax).all(), "root mask incomplete"
    times = []
    for fn in (mask, select):
        fn()
        start, end = cuda.event(), cuda.event()
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(cuda.event_elapsed_time(start, end) * 1e3 / reps)
    return times


def main():
    tok = ModelTokenizer(make_tokenizer_dir(Path(tempfile.mkdtemp())))
    trie = compile_catalog(parse_registry(catalog_path("metatool").read_text()), tok)
    packed = cs.pack_trie(trie)
    cs.ConstantTrie().bind(("metatool", 1), packed)
    print(f"MetaTool trie: {trie.num_nodes} nodes, {trie.num_edges} edges, root fan-out {trie.max_fanout()}, "
          f"{len(packed) * 4} bytes packed")
    print("| rows | k_mask const µs | k_mask global µs | k_select µs |\n| --- | --- | --- | --- |")
    for n in (1, 16, 64, 256):
        (mc, sel), (mg, _) = time_kernels(trie, packed, 1, n), time_kernels(trie, packed, 0, n)
        print(f"| {n} | {mc:.1f} | {mg:.1f} | {sel:.1f} |")


if __name__ == "__main__":
    main()

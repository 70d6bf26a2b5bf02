"""GPU timing of the sampler kernels: constant-memory trie vs global-memory trie, by batch size.

    python3 bench/gpu_sampler_bench.py     (on the GPU machine; TOOLTRIE_SHARED_DATA may point at the data)

Rows sit at the MetaTool trie's root (its widest node, the worst case for k_mask). Times are CUDA
events around 200 raw launches of each kernel (the engine's launch path, launcher.Launch). k_mask is
timed at the root every time; k_select after it (its cost does not depend on the node).
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

from bench.constrained_step import root_launches  # noqa: E402
from compiler_service.compiler import compile_catalog  # noqa: E402
from decoder_service.engine import cuda_sampler as cs  # noqa: E402
from decoder_service.model.cuda.launcher import Stream, event_ms, new_event  # noqa: E402
from numba import cuda  # noqa: E402
from shared.catalog import parse_registry  # noqa: E402
from shared.tokenizer import ModelTokenizer  # noqa: E402
from tokenizer_fixtures import catalog_path, make_tokenizer_dir  # noqa: E402


def time_kernels(trie, packed, use_const, n_rows, stream, reps=200):
    """(k_mask µs, k_select µs) per launch for n_rows rows at the root."""
    cmax = trie.max_fanout()
    logits = cuda.to_device(np.random.default_rng(0).standard_normal(n_rows * cmax).astype(np.float32))
    mask, select, _, cand = root_launches(packed, n_rows, use_const, cmax, stream.handle, logits)
    ncand, status = cand["count"], cand["status"]
    mask.launch(n_rows)
    stream.synchronize()
    assert (status.copy_to_host() == 0).all() and (ncand.copy_to_host() == cmax).all(), "root mask incomplete"
    times = []
    start, end = new_event(True), new_event(True)
    for launch in (mask, select):
        launch.launch(n_rows)
        stream.record(start)
        for _ in range(reps):
            launch.launch(n_rows)
        stream.record(end)
        stream.synchronize()
        times.append(event_ms(start, end) * 1e3 / reps)
    return times


def main():
    tok = ModelTokenizer(make_tokenizer_dir(Path(tempfile.mkdtemp())))
    trie = compile_catalog(parse_registry(catalog_path("metatool").read_text()), tok)
    packed = cs.pack_trie(trie)
    stream = Stream()
    cs.ConstantTrie(cs.SamplerKernels.get()).bind(("metatool", 1), packed, stream)
    print(f"MetaTool trie: {trie.num_nodes} nodes, {trie.num_edges} edges, root fan-out {trie.max_fanout()}, "
          f"{len(packed) * 4} bytes packed")
    print("| rows | k_mask const µs | k_mask global µs | k_select µs |\n| --- | --- | --- | --- |")
    for n in (1, 16, 64, 256):
        (mc, sel), (mg, _) = time_kernels(trie, packed, 1, n, stream), time_kernels(trie, packed, 0, n, stream)
        print(f"| {n} | {mc:.1f} | {mg:.1f} | {sel:.1f} |")


if __name__ == "__main__":
    main()

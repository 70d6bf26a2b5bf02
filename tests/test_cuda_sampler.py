"""The GPU sampler kernels (k_mask, k_select) against the host sampler, under numba's CUDA simulator.

Rows of two catalogs share one batch: MetaTool's trie is resident in constant memory, Seal-Tools' and
ToolBench's are read from the global arena, so both paths run side by side. For random reachable
states (node, emitted pointers, k, allowlist) the kernels must give exactly the host's candidates in
the same order, the same winner, the same advance, the log-probability to float64 rounding, and the done
flag the engine would read there (the stop, or a last name left alone below the pick: the engine's
CatalogRuntime.last_pointer_edge, computed its own way, says which). A
stale binding (constant memory holding another catalog) must change the answer, which is what the
engine's host walk then catches.

The kernels run in a subprocess with NUMBA_ENABLE_CUDASIM=1 (numba reads it at import; other test
files use real numba). On a GPU machine the same checks run for real in the `gpu`-marked test.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from sim_runner import run_script


def run_checks(sim: bool) -> dict:
    return run_script(__file__, sim)


def test_kernels_match_the_host_sampler_under_the_simulator():
    result = run_checks(sim=True)
    assert result["rows"] >= 24 and result["mismatches"] == [], result["mismatches"][:5]
    assert 0 < result["done_rows"] < result["rows"], result   # rows whose pick ends the answer, and others
    assert result["prior_rows"] > 0   # rows whose pick fuses a retrieval prior
    assert result["stale_binding_changed_answers"] > 0


@pytest.mark.gpu
def test_kernels_match_the_host_sampler_on_the_gpu():
    from numba import cuda
    if not cuda.is_available():
        pytest.skip("no CUDA GPU")
    result = run_checks(sim=False)
    assert result["mismatches"] == [] and result["stale_binding_changed_answers"] > 0


# --- the checks, run in the subprocess ----------------------------------------------------------

def host_state_after(trie, k, allow, rng, steps):
    """Walk a random legal path with the host sampler: a reachable (node, emitted) state."""
    from decoder_service.engine.sampler import SEP, STOP, legal_edges
    node, emitted = 0, np.full(k, -1, np.int32)
    n = 0
    buf = np.empty(4096, np.int32)
    for _ in range(steps):
        c = legal_edges(node, trie.node_edge_start, trie.edge_child, trie.edge_lo, trie.edge_hi, emitted, n, k,
                        allow, len(allow) == 0, buf)
        e = buf[rng.randrange(c)]
        child = trie.edge_child[e]
        if child == STOP:
            break
        if child == SEP:
            emitted[n] = trie.edge_lo[e]
            n += 1
            node = 0
        else:
            node = child
    return node, emitted, n


def main() -> None:
    from numba import cuda

    from compiler_service.compiler import compile_catalog
    from decoder_service.engine import cuda_sampler as cs
    from decoder_service.engine import device_trie as dt
    from decoder_service.engine.catalog_runtime import CatalogRuntime
    from decoder_service.engine.sampler import SEP, STOP, edge_priors, legal_edges, select
    from decoder_service.gpu import sim_accel
    from decoder_service.gpu.launcher import Stream
    from shared.catalog import parse_registry
    from shared.tokenizer import ModelTokenizer
    from tokenizer_fixtures import catalog_path, make_tokenizer_dir
    import tempfile
    from types import SimpleNamespace
    sim_accel.install()
    tok = ModelTokenizer(make_tokenizer_dir(Path(tempfile.mkdtemp())))
    tries = {n: compile_catalog(parse_registry(catalog_path(n).read_text()), tok)
             for n in ("metatool", "bigcatalog", "toolbench")}
    packed = {n: dt.pack_trie(t) for n, t in tries.items()}
    assert dt.fits_constant_memory(packed["metatool"])
    # the compiler's stat and the device's placement measure the same bytes
    assert all(tries[n].packed_nbytes == p.nbytes and tries[n].fits_constant_memory == dt.fits_constant_memory(p)
               for n, p in packed.items())
    arena_parts, base = [], {}
    offset = 0
    for n, p in packed.items():
        base[n] = offset
        arena_parts.append(p)
        offset += len(p)
    arena = np.concatenate(arena_parts)
    rng = random.Random(5)
    rows = []
    for i in range(24):
        name = ["metatool", "bigcatalog", "toolbench"][i % 3]
        trie = tries[name]
        k = rng.randint(1, 5)
        allow = np.empty(0, np.int32)
        if i % 4 == 3:
            allow = np.unique(np.asarray(rng.sample(range(len(trie.pointer_names)), k + 3), np.int32))
        node, emitted, n = host_state_after(trie, k, allow, rng, rng.randint(0, 12))
        rows.append((name, k, allow, node, emitted, n))
    N = len(rows)
    kmax = max(r[1] for r in rows)
    cmax = max(t.max_fanout() for t in tries.values())
    allow_arena = np.concatenate([r[2] for r in rows] + [np.zeros(1, np.int32)]).astype(np.int32)
    allow_start = np.cumsum([0] + [len(r[2]) for r in rows[:-1]]).astype(np.int32)
    allow_len = np.asarray([len(r[2]) if len(r[2]) else -1 for r in rows], np.int32)
    # retrieval priors (fusion) beside half the allowlists: whole numbers, so that some edges tie
    prior_arena = np.asarray([rng.choice([0.0, -1.0, -2.0, -3.0]) for _ in range(len(allow_arena))], np.float32)
    with_prior = np.asarray([len(r[2]) > 0 and i % 8 == 3 for i, r in enumerate(rows)], np.int32)
    emitted = np.full((N, kmax), -1, np.int32)
    for i, r in enumerate(rows):
        emitted[i, :r[1]] = r[4]

    kernels, stream = dt.TrieKernels.get(), Stream()

    def launch():
        """k_mask then k_select over every row, packed and launched as the engine's are
        (device_trie.sampler_launches)."""
        d = {
            "base": np.asarray([0 if r[0] == "metatool" else base[r[0]] for r in rows], np.int32),
            "const": np.asarray([1 if r[0] == "metatool" else 0 for r in rows], np.int32),
            "node": np.asarray([r[3] for r in rows], np.int32), "emitted": emitted.ravel().copy(),
            "n_emitted": np.asarray([r[5] for r in rows], np.int32), "k": np.asarray([r[1] for r in rows], np.int32),
            "allow_start": allow_start, "allow_len": allow_len, "prior": with_prior,
        }
        dev = {key: cuda.to_device(v) for key, v in d.items()}
        cand = {key: cuda.to_device(np.full(N * cmax, -1, np.int32))
                for key in ("token", "child", "lo", "edge", "ends")}
        cand["bias"] = cuda.to_device(np.zeros(N * cmax, np.float32))
        ncand, status = cuda.to_device(np.zeros(N, np.int32)), cuda.to_device(np.zeros(N, np.int32))
        logits = np.round(np.asarray([[rng.gauss(0, 1) for _ in range(cmax)] for _ in range(N)], np.float32), 1)
        out = {key: cuda.to_device(np.zeros(N, dt)) for key, dt in
               (("done", np.int32), ("token", np.int32), ("edge", np.int32), ("logprob", np.float64))}
        mask, select = dt.sampler_launches(kernels, stream.handle, cuda.to_device(arena), dev, kmax,
                                           cuda.to_device(allow_arena), cuda.to_device(prior_arena), True,
                                           {**cand, "count": ncand, "status": status}, cmax,
                                           cuda.to_device(logits.ravel()), out)
        mask.launch(N)
        select.launch(N)
        stream.synchronize()
        return (ncand.copy_to_host(), cand["edge"].copy_to_host().reshape(N, cmax), status.copy_to_host(),
                logits, {key: v.copy_to_host() for key, v in out.items()})

    dt.ConstantTrie(kernels).bind(("metatool", 1), packed["metatool"], stream)
    nc, edges, status, logits, out = launch()
    mismatches, done_rows = [], 0
    forced = {name: CatalogRuntime.from_trie(t, None, tok, 16).last_pointer_edge for name, t in tries.items()}
    for i, (name, k, allow, node, em, n) in enumerate(rows):
        t = tries[name]
        buf = np.empty(4096, np.int32)
        c = legal_edges(node, t.node_edge_start, t.edge_child, t.edge_lo, t.edge_hi, em, n, k, allow,
                        len(allow) == 0, buf)
        row = SimpleNamespace(allow=allow, allow_all=not len(allow), catalog=SimpleNamespace(max_fanout=t.max_fanout()))
        if c > cs.most_candidates(row):   # the bound that keeps a shortlisted row on the device
            mismatches.append(f"row {i} ({name}): {c} legal edges, over the bound for {len(allow)} allowed tools")
        if status[i] != dt.OK or nc[i] != c or list(edges[i, :c]) != list(buf[:c]):
            mismatches.append(f"row {i} ({name}): mask {list(edges[i, :nc[i]])[:8]} vs host {list(buf[:c])[:8]}")
            continue
        bias = None
        if with_prior[i]:
            p = prior_arena[allow_start[i]:allow_start[i] + len(allow)]
            bias = edge_priors(buf[:c], t.edge_lo, t.edge_hi, em, n, allow, p)
        win, lp = select(logits[i, :c], t.edge_token[buf[:c]], bias)
        if out["edge"][i] != buf[win] or abs(out["logprob"][i] - lp) > 1e-9 * max(1.0, abs(lp)):
            mismatches.append(f"row {i} ({name}): winner {out['edge'][i]} lp {out['logprob'][i]} vs {buf[win]} {lp}")
        child = t.edge_child[buf[win]]
        ends = child == STOP or (child != SEP and n + 1 == k and forced[name][child] >= 0)
        done_rows += int(ends)
        if out["done"][i] != ends:
            mismatches.append(f"row {i} ({name}): done {out['done'][i]}, the engine's rule says {int(ends)}")
    # a stale binding: constant memory now holds another version (half the tools) while rows still
    # read it as this MetaTool version
    from shared.catalog import registry_from_entries
    other = compile_catalog(registry_from_entries(json.loads(catalog_path("metatool").read_text())[::2]), tok)
    dt.ConstantTrie(kernels).bind(("metatool", 2), dt.pack_trie(other), stream)
    nc2, edges2, _, _, _ = launch()
    changed = sum(1 for i, r in enumerate(rows) if r[0] == "metatool" and
                  (nc2[i] != nc[i] or list(edges2[i, :nc2[i]]) != list(edges[i, :nc[i]])))
    print("RESULT " + json.dumps({"rows": N, "mismatches": mismatches, "done_rows": done_rows,
                                  "prior_rows": int(with_prior.sum()),
                                  "stale_binding_changed_answers": changed}))


if __name__ == "__main__":
    main()

"""The engine with the device sampler (k_mask -> sparse head -> k_select), under numba's CUDA simulator.

The sampler kernels run in the simulator; the model runs on the CPU backend, and its sparse head is
served to the kernels through device buffers shaped like the CUDA backend's (`cand`, `ncand`,
`sparse`). The CUDA model kernels themselves are checked against the reference in
test_model_cuda_sim.py; running them here too would take the simulator minutes per request. On a
real GPU the `gpu` test runs the same script on the real CUDA backend.

Checks: the same requests (their answers' order fused with the shortlist's retrieval prior) give the host
sampler's names, with log-probabilities equal to float64 rounding, for two catalog versions alternating in one
batch stream (one resident in constant memory, one read from the global arena), served together and one at a
time. Either way the engine launches steps ahead of the picks (the next step fed the device's tokens and trie
state before the host reads them; never with the host sampler) and takes forced tokens without steps of their
own, and one at a time its answers equal, to the bit, those of an engine with step_ahead, finish_forced and
forced_runs off, and a step launched ahead of an answer that completes at the read is dropped without being read,
its forward pass skipped on the device by the sampler's done flags (exactly those steps: counted under the
simulator). A stale constant-memory binding fails the requests loudly (INTERNAL), never with a plausible
answer.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from sim_runner import run_script


def run(sim: bool) -> dict:
    return run_script(__file__, sim)


def check(result: dict) -> None:
    assert result["requests"] >= 8 and result["differences"] == [], result["differences"][:3]
    host, batched, alone, off = result["steps_ahead"]  # the host sampler's picks cannot feed a step ahead
    assert host == 0 and batched > 0 and alone > 0 and off == 0, result["steps_ahead"]
    # one at a time, a step launched ahead of an answer that completes at the read is dropped unread
    assert result["steps_dropped"][2] > 0 and result["steps_dropped"][3] == 0, result["steps_dropped"]
    # the device's done flags skip the forward pass of exactly the steps the host drops (the simulator's
    # stand-in backend counts them; on the GPU a wrong skip shows as answers that differ)
    assert result["forwards_skipped"] in (None, result["steps_dropped"]), result
    assert all(result["tokens_forced"][:3]) and result["tokens_forced"][3] == 0, result["tokens_forced"]
    assert result["levers_are_exact"]  # same names, same log-probabilities to the bit, with the three settings off
    assert result["resident_rows"] > 0 and result["arena_rows"] > 0
    assert result["stale"] and all("stale or corrupted trie" in m or "empty mask" in m for m in result["stale"])


def test_device_sampler_engine_matches_the_host_sampler_under_the_simulator():
    check(run(sim=True))


@pytest.mark.gpu
def test_device_sampler_engine_matches_the_host_sampler_on_the_gpu():
    from numba import cuda
    if not cuda.is_available():
        pytest.skip("no CUDA GPU")
    check(run(sim=False))


class CpuModelDeviceHead:
    """The CPU backend, with its sparse head read from and written to device buffers the way the CUDA
    backend's is (`cand` [N, C], `ncand` [N], `sparse` [N, C]): what the device sampler needs."""

    name = "cuda"

    def __init__(self, cpu, max_logit_rows: int, max_candidates: int):
        from numba import cuda

        from decoder_service.gpu.launcher import Stream
        self.cpu, self.cfg, self.stream = cpu, cpu.cfg, Stream()
        self.skipped = 0   # forward passes a step's done flags skipped
        self.max_logit_rows, self.max_candidates = max_logit_rows, max_candidates
        self.cand = cuda.to_device(__import__("numpy").zeros(max_logit_rows * max_candidates, "int32"))
        self.ncand = cuda.to_device(__import__("numpy").zeros(max_logit_rows, "int32"))
        self.sparse = cuda.to_device(__import__("numpy").zeros(max_logit_rows * max_candidates, "float32"))

    def forward(self, batch, device_tokens=None, skip_if_done=None):
        if skip_if_done is not None and skip_if_done.copy_to_host()[:batch.num_rows].all():
            self.skipped += 1   # the CUDA backend's gated graph: no forward pass, K/V and hidden untouched
            return
        if device_tokens is not None:  # the CUDA backend copies them in stream order; here, now
            batch = dataclasses.replace(batch, tokens=device_tokens.copy_to_host()[:batch.num_rows].copy())
        self.cpu.forward(batch)

    def sparse_logits(self, cand, n):
        return self.cpu.sparse_logits(cand, n)

    def copy_kv(self, src_block, dst_block, count):
        self.cpu.copy_kv(src_block, dst_block, count)

    def place_kv(self, src, dst, shift):
        self.cpu.place_kv(src, dst, shift)

    def launch_sparse(self, n: int) -> None:
        import numpy as np
        c = self.max_candidates
        cand = self.cand.copy_to_host()[: n * c].reshape(n, c)
        counts = self.ncand.copy_to_host()[:n]
        cand = np.where(np.arange(c)[None, :] < counts[:, None], cand, cand[:, :1])  # unused slots: any id
        out = np.zeros(self.max_logit_rows * c, np.float32)
        out[: n * c] = self.cpu.sparse_logits(np.ascontiguousarray(cand, np.int32), counts).reshape(-1)
        self.sparse.copy_to_device(out)


def device_stack():
    """(simulated, tokenizer, config, KV spec, backend) of a tiny model with the device sampler's head: the
    CUDA backend on a GPU, the CPU model behind the simulated device head under the simulator."""
    import tempfile

    from decoder_service.model.config import ModelConfig
    from decoder_service.gpu import sim_accel
    from decoder_service.model.kv_pool import KVPoolSpec
    from decoder_service.model.weights import load_weights
    from model_fixtures import make_tiny_model
    from shared.tokenizer import ModelTokenizer
    from tokenizer_fixtures import make_tokenizer_dir
    simulated = sim_accel.install()
    tmp = Path(tempfile.mkdtemp())
    tok = ModelTokenizer(make_tokenizer_dir(tmp / "tok"))
    model = make_tiny_model(tmp, "llama", "float32", tied=True, seed=2,
                            config_overrides={"vocab_size": tok.tokenizer.get_vocab_size(),
                                              "max_position_embeddings": 4096})
    cfg = ModelConfig.from_dir(model)
    spec = KVPoolSpec(512, 16)
    weights = load_weights(model, cfg, "float32")
    if simulated:
        from decoder_service.model.cpu import CpuBackend
        backend = CpuModelDeviceHead(CpuBackend(cfg, weights, spec), max_logit_rows=16, max_candidates=128)
    else:
        from decoder_service.model.cuda.backend import CudaBackend
        backend = CudaBackend(cfg, weights, spec, max_rows=512, max_logit_rows=16, max_candidates=128)
    return simulated, tok, cfg, spec, backend


def main() -> None:
    import numpy as np

    from compiler_service.compiler import compile_catalog
    from decoder_service.engine import cuda_sampler as cs
    from decoder_service.engine.engine import DecodeEngine, EngineConfig
    from decoder_service.engine.sampler import HostSampler
    from decoder_service.engine.sequence import DoneEvent, FailedEvent
    from decoder_service.engine.device_trie import pack_trie
    from shared.catalog import registry_from_entries
    from tokenizer_fixtures import catalog_path
    simulated, tok, cfg, spec, backend = device_stack()
    tools = json.loads(catalog_path("metatool").read_text())
    tries = [compile_catalog(registry_from_entries(tools[:30]), tok),
             compile_catalog(registry_from_entries(tools[10:45]), tok)]
    for version, trie in enumerate(tries, 1):
        trie.meta.update(name="demo", version=version)
    requests = [("weather in paris", 2), ("a podcast please", 1), ("stocks and news", 3), ("find a recipe", 2)]

    def serve(sampler, stale=False, one_at_a_time=False, **config):
        skipped_before = getattr(backend, "skipped", 0)
        engine = DecodeEngine(backend, tok, spec.num_blocks, spec.block_size, cfg.max_position_embeddings,
                              EngineConfig(**{"fusion_weight": 0.7, **config}))  # the retrieval prior in the pick
        engine.sampler = sampler
        catalogs = [engine.load_catalog(t) for t in tries]
        engine.run_until_idle()
        if isinstance(sampler, cs.DeviceSampler):
            for rt in catalogs:  # version 2 is bound last: it is the one in constant memory
                sampler.bind(rt)
            if stale:  # constant memory holds version 1 while the sampler believes version 2 is there
                sampler.trie.constant.bind(catalogs[1].key, pack_trie(tries[0]), backend.stream)
        seqs = []
        for i, (intent, k) in enumerate(requests * 2):
            seqs.append(engine.submit(catalogs[i % 2], intent, k))
            if one_at_a_time:
                engine.run_until_idle()
        engine.run_until_idle()
        ahead.append(engine.steps_ahead)
        dropped.append(engine.steps_dropped)
        skipped.append(getattr(backend, "skipped", 0) - skipped_before)
        forced.append(engine.tokens_forced)
        out = []
        for seq in seqs:
            events = list(seq)
            out.append(events[-1].message if isinstance(events[-1], FailedEvent) else
                       [(e.name, e.logprob) for e in events if not isinstance(e, DoneEvent)])
        return out

    # by serve() call: steps launched ahead (dropped unread; their forward skipped), tokens taken without a step
    ahead, dropped, skipped, forced = [], [], [], []
    expected = serve(HostSampler(backend))
    device = cs.DeviceSampler(backend, HostSampler(backend))
    got = serve(device)
    alone = serve(cs.DeviceSampler(backend, HostSampler(backend)), one_at_a_time=True)
    in_turn = serve(cs.DeviceSampler(backend, HostSampler(backend), finish_forced=False), one_at_a_time=True,
                    step_ahead=False, finish_forced=False, forced_runs=False)
    differences = [f"{e} vs {g}" for e, g in [*zip(expected, got), *zip(expected, alone)]
                   if isinstance(e, str) or isinstance(g, str) or [n for n, _ in e] != [n for n, _ in g]
                   or not np.allclose([s for _, s in e], [s for _, s in g], rtol=1e-9, atol=1e-12)]
    resident = sum(1 for i in range(len(got)) if i % 2 == 1)
    stale = serve(cs.DeviceSampler(backend, HostSampler(backend)), stale=True)
    print("RESULT " + json.dumps({"requests": len(got), "differences": differences, "resident_rows": resident,
                                  "arena_rows": len(got) - resident, "owner": list(device.trie.constant.owner),
                                  "stale": [m for m in stale if isinstance(m, str)],
                                  "steps_ahead": ahead[:4], "steps_dropped": dropped[:4],
                                  "forwards_skipped": skipped[:4] if simulated else None,
                                  "tokens_forced": forced[:4], "levers_are_exact": alone == in_turn}))


if __name__ == "__main__":
    main()

"""A catalog version is made resident on the device at the version switch, never inside a decode step.

Under numba's CUDA simulator (the device sampler's kernels simulated, the model on the CPU backend behind the
CUDA backend's sparse-head buffers, as in test_engine_cuda_sim.py; the `gpu` test runs the real CUDA backend):
the CatalogManager makes version 1 the default, requests run, then version 2 is made the default while version
1's requests are still decoding (each has had its first pick, none has ended). The swap binds version 2 (arena
upload, constant memory) at the engine's next step, before anything else of that step, which moves version 1 out
of constant memory. The engine's own order of events says so: each version's bind comes in the step after its
switch and before the first step that runs any row of a request of that version, and no step is launched ahead
of picks staged before a bind (without that guard their next step reads version 2's trie as version 1's: a
stale-trie failure). The first request on version 2 then stages and picks without any upload or bind inside its
steps, and every answer, before, across and after the swap, is bit-identical to the same requests on an engine
that binds lazily (the old way: at a version's first sampled step) and has the host sampler's names.

Whether a step of version 1's rows is launched ahead at the swap depends on the model's picks (the tiny model's
logits differ between the CPU backend and a GPU, and so do the steps the engine may take ahead): under the
simulator it is (the guard's case, asserted there); on a GPU the assertions above hold either way.
"""
from __future__ import annotations

import json

import pytest

from sim_runner import run_script


def check(result: dict, sim: bool) -> None:
    assert result["answers_identical"], result["differences"][:3]
    assert result["names_match_host"], result["differences"][:3]
    assert result["bound_at_switch"] == {"uploads": 1, "binds": 1}, result
    assert result["first_request_after_swap"] == {"uploads": 0, "binds": 0, "lazy_binds": 0}, result
    assert result["lazy_binds_without_manager"] == 2   # the old way: each version bound in a step
    assert result["constant_owner"] == ["demo", 2]
    # the engine's order of events (steps counted from the first managed one): each version bound once, in the
    # step right after its switch, before any step runs a row of that version's requests
    order = result["order"]
    assert [v for v, _ in order["binds"]] == [1, 2], order
    events = [tuple(e) for e in order["events"]]
    for version, step in order["binds"]:
        assert step == order["switched"][str(version)] + 1, order
        assert step <= order["first_launch"][str(version)], order
        assert events.index(("bind", version)) < events.index(("launch", version)), order
    assert order["mid_answer_at_swap"], order    # version 1's requests decode across the swap
    assert order["stale_ahead"] == 0, order       # never a step ahead of picks staged before a bind
    assert order["guard"] == [True, True], order  # the sampler refuses to: picks it stepped ahead of until then
    if sim:   # the CPU backend's picks: a step of version 1's rows is launched ahead as the swap lands
        assert result["ahead_at_swap"], result


def test_a_version_is_bound_at_the_switch_not_in_the_step():
    check(run_script(__file__, sim=True), sim=True)


@pytest.mark.gpu
def test_a_version_is_bound_at_the_switch_on_the_gpu():
    from numba import cuda
    if not cuda.is_available():
        pytest.skip("no CUDA GPU")
    check(run_script(__file__, sim=False), sim=False)


def main() -> None:
    import numpy as np

    from compiler_service.compiler import compile_catalog
    from decoder_service.catalogs import CatalogManager, CatalogState
    from decoder_service.engine.cuda_sampler import DeviceSampler
    from decoder_service.engine.engine import DecodeEngine, EngineConfig
    from decoder_service.engine.sampler import HostSampler
    from decoder_service.engine.sequence import DoneEvent, FailedEvent, State
    from shared.catalog import registry_from_entries
    from test_engine_cuda_sim import device_stack
    from tokenizer_fixtures import catalog_path
    simulated, tok, cfg, spec, backend = device_stack()
    tools = json.loads(catalog_path("metatool").read_text())
    tries = {1: compile_catalog(registry_from_entries(tools[:30]), tok),
             2: compile_catalog(registry_from_entries(tools[10:45]), tok)}
    for version, trie in tries.items():
        trie.meta.update(name="demo", version=version)
    before = [("weather in paris", 3), ("a podcast please", 3), ("stocks and news", 3)]
    after = [("find a recipe", 2), ("weather in paris", 1), ("news about stocks", 2)]

    def engine_with(sampler):
        engine = DecodeEngine(backend, tok, spec.num_blocks, spec.block_size, cfg.max_position_embeddings,
                              EngineConfig(fusion_weight=0.7))
        engine.sampler = sampler(backend)
        return engine

    def answers(seqs):
        out = []
        for seq in seqs:
            events = list(seq)
            out.append(events[-1].message if isinstance(events[-1], FailedEvent) else
                       [(e.name, np.float64(e.logprob).tobytes().hex())
                        for e in events if not isinstance(e, DoneEvent)])
        return out

    def serve(sampler, managed: bool):
        """v1 requests, the swap to v2 while they decode, v2 requests; counters around the swap's first
        request. Managed: through CatalogManager.make_default (the binding hook), with the engine's order of
        events logged; else the runtimes are used directly and the sampler binds each version at its first step."""
        engine = engine_with(sampler)
        runtimes = {v: engine.load_catalog(t) for v, t in tries.items()}
        engine.run_until_idle()
        trie = getattr(engine.sampler, "trie", None)
        order = {"binds": [], "switched": {}, "first_launch": {}, "stale_ahead": 0, "aheads": 0}
        if managed:
            order = log_order(engine, trie, order)
        manager = CatalogManager(None, engine)   # no store: load() returns the warmed runtimes
        manager.load = lambda name, version, superseded=None: runtimes[version]
        pick = (lambda: manager.acquire("demo")) if managed else None
        if managed:
            manager.catalog_states["demo"] = CatalogState("demo", wanted=1)   # as announce() records it
            order["switched"]["1"] = order["steps"]
            manager.make_default("demo", 1)
        first = [engine.submit(pick() if managed else runtimes[1], intent, k) for intent, k in before]
        assert all(k >= 3 for _, k in before)   # so a row that has emitted at most one name is mid-answer
        for _ in range(50):   # version 1's requests mid-answer at the swap: each has had its first pick
            engine.step()
            if managed and all(s.generated for s in first) and (
                    engine._ahead is not None or any(s.n_emitted for s in first)):
                # a step of theirs launched ahead of their picks, which the swap's step must not step ahead of
                # (where the model's picks let the engine step ahead by then), or a name emitted: swap now
                break
        ahead_at_swap = engine._ahead is not None
        order["mid_answer_at_swap"] = all(s.state != State.FINISHED and s.n_emitted < s.k for s in first)

        def counts():
            return {"uploads": trie.uploads, "binds": trie.epoch} if trie else {}

        start = counts()
        if managed:
            staged = order["picks"][-1]   # the last picks staged before the swap: stepped ahead of until the bind,
            order["guard"] = [engine.sampler.next_tokens(staged) is not None]   # never after it
            manager.catalog_states["demo"].wanted = 2
            order["switched"]["2"] = order["steps"]
            manager.make_default("demo", 2)
            engine.step()   # the next step drains the bind
            order["guard"].append(engine.sampler.next_tokens(staged) is None)
        at_switch = {k: v - start[k] for k, v in counts().items()} if trie else {}
        start, lazy = counts(), getattr(engine.sampler, "lazy_binds", 0)
        second = [engine.submit(pick() if managed else runtimes[2], *after[0])]
        engine.run_until_idle()
        first_after = {**{k: v - start[k] for k, v in counts().items()},
                       "lazy_binds": getattr(engine.sampler, "lazy_binds", 0) - lazy} if trie else {}
        second += [engine.submit(pick() if managed else runtimes[2], intent, k) for intent, k in after[1:]]
        engine.run_until_idle()
        owner = list(trie.constant.owner) if trie else None
        order.pop("picks", None)
        return (answers(first + second), at_switch, first_after, getattr(engine.sampler, "lazy_binds", 0), owner,
                ahead_at_swap, order)

    def log_order(engine, trie, order):
        """Count the engine's steps and note, in order, each bind (a version and the step it came in), each
        version's first step that runs a row of its requests (a warm-up's prefill is not a request), and each step
        launched ahead of picks staged before the last bind (stale_ahead); keep the sampler's picks (the last one
        before the swap is asked about). The engine and its sampler call these through the instance, so wrapping
        them there sees every call."""
        order["steps"], order["picks"] = 0, []
        events = []   # (kind, version), in the order the engine did them
        step, bind, launch, ahead = engine.step, trie.bind, engine._launch, engine._launch_ahead
        start, follow = engine.sampler.start, engine.sampler.follow

        def counted_step():
            order["steps"] += 1
            return step()

        def logged_bind(key, t, constant=True):
            events.append(("bind", key[1]))
            order["binds"].append((key[1], order["steps"]))
            return bind(key, t, constant)

        def logged_launch(chunks):
            for version in sorted({seq.catalog.key[1] for seq, *_ in chunks if not seq.warmup}):
                events.append(("launch", version))
                order["first_launch"].setdefault(str(version), order["steps"])
            return launch(chunks)

        def logged_ahead(launched):
            order["aheads"] += 1
            order["stale_ahead"] += launched.picks.epoch != trie.epoch
            return ahead(launched)

        def kept(staging):
            def call(arg):
                picks = staging(arg)
                order["picks"].append(picks)
                return picks
            return call

        engine.step, trie.bind, engine._launch, engine._launch_ahead = counted_step, logged_bind, logged_launch, \
            logged_ahead
        engine.sampler.start, engine.sampler.follow = kept(start), kept(follow)
        order["events"] = events
        return order

    host, *_ = serve(lambda be: HostSampler(be), managed=False)
    lazy, _, _, lazy_binds, _, _, _ = serve(lambda be: DeviceSampler(be, HostSampler(be)), managed=False)
    bound, at_switch, first_after, _, owner, ahead, order = serve(lambda be: DeviceSampler(be, HostSampler(be)),
                                                                  managed=True)
    differences = [f"{a} vs {b}" for a, b in zip(lazy, bound) if a != b]

    def names(ans):
        return [[n for n, _ in a] if isinstance(a, list) else a for a in ans]

    differences += [f"host {a} vs {b}" for a, b in zip(names(host), names(bound)) if a != b]
    print("RESULT " + json.dumps({
        "answers_identical": lazy == bound and all(isinstance(a, list) for a in bound),
        "names_match_host": names(host) == names(bound), "differences": differences,
        "bound_at_switch": at_switch, "first_request_after_swap": first_after,
        "lazy_binds_without_manager": lazy_binds, "constant_owner": owner, "ahead_at_swap": ahead,
        "order": order}))


if __name__ == "__main__":
    main()

"""A tiny random model that speaks the small test tokenizer, and an engine around it (CPU backend)."""
from __future__ import annotations

import contextlib
import json
import threading

from compiler_service.compiler import compile_catalog
from decoder_service.engine.engine import DecodeEngine, EngineConfig
from decoder_service.model.config import ModelConfig
from decoder_service.model.cpu import CpuBackend
from decoder_service.model.kv_pool import KVPoolSpec
from decoder_service.model.weights import load_weights
from model_fixtures import make_tiny_model
from shared.catalog import registry_from_entries
from shared.tokenizer import ModelTokenizer
from tokenizer_fixtures import catalog_path

BLOCK_SIZE = 16


def tiny_backend(tmp_path, vocab_size: int, num_blocks: int, seed: int = 0, max_positions: int = 8192):
    model_dir = make_tiny_model(tmp_path, "llama", "float32", tied=True, seed=seed,
                                config_overrides={"vocab_size": vocab_size,
                                                  "max_position_embeddings": max_positions})
    cfg = ModelConfig.from_dir(model_dir)
    return CpuBackend(cfg, load_weights(model_dir, cfg, "float32"), KVPoolSpec(num_blocks, BLOCK_SIZE))


def make_engine(backend, tok: ModelTokenizer, num_blocks: int, tuned_tools: frozenset[str] = frozenset(),
                **config) -> DecodeEngine:
    return DecodeEngine(backend, tok, num_blocks=num_blocks, block_size=BLOCK_SIZE,
                        max_positions=backend.cfg.max_position_embeddings, config=EngineConfig(**config),
                        tuned_tools=tuned_tools)


def metatool_trie(tok: ModelTokenizer, first: int | None = None):
    tools = json.loads(catalog_path("metatool").read_text())[:first]
    return compile_catalog(registry_from_entries(tools), tok)


def names_trie(tok: ModelTokenizer, names: list[str]):
    return compile_catalog(registry_from_entries([{"name": n} for n in names]), tok)


def answer(seq):
    """(names, logprobs, done) of a finished sequence's stream; raises on a Failed event."""
    from decoder_service.engine.sequence import DoneEvent, FailedEvent
    names, scores, done = [], [], None
    for event in seq:
        if isinstance(event, FailedEvent):
            raise AssertionError(f"{event.kind}: {event.message}")
        if isinstance(event, DoneEvent):
            done = event
        else:
            names.append(event.name)
            scores.append(event.logprob)
    return names, scores, done


@contextlib.contextmanager
def paused(engine: DecodeEngine):
    """The engine's own thread holds before its next step until the block ends (entered once no step is under
    way; another thread may step it meanwhile): requests queue, and their deadlines and cancellations are taken
    when it resumes."""
    gate, held, step = threading.Event(), threading.Event(), engine.step

    def hold():
        if threading.current_thread() is engine._thread:
            held.set()
            gate.wait()
        return step()
    engine.step = hold
    try:
        if engine._thread is not None and engine._thread.is_alive():
            engine._post(("wake", None))
            assert held.wait(10), "the engine's loop did not reach its next step"
        yield
    finally:
        gate.set()
        del engine.step

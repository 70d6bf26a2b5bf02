"""Admission bounds running work to what finishes (issue 53, finding 6): a burst of requests that cannot all meet
their deadline is answered in time or refused early (RESOURCE_EXHAUSTED), never left to expire after running."""
import threading
import time

from decoder_service.engine.engine import QueueFull
from decoder_service.engine.sequence import DoneEvent, FailedEvent
from engine_fixtures import make_engine, metatool_trie, tiny_backend
from shared.tokenizer import ModelTokenizer

NUM_BLOCKS = 1024
STEP_SECONDS = 0.02   # each forward pass is slowed to this, so that a request takes steps' worth of time


def slowed(backend):
    forward = backend.forward

    def slow(*a, **kw):
        time.sleep(STEP_SECONDS)
        return forward(*a, **kw)
    backend.forward = slow
    return backend


def outcome(seq, deadline: float) -> str:
    """done (and whether by its deadline), or the failure's kind."""
    for event in seq:
        if isinstance(event, FailedEvent):
            return event.kind
        if isinstance(event, DoneEvent):
            return "done" if time.monotonic() <= deadline else "done late"
    raise AssertionError("the stream ended without Done")


def test_a_burst_is_answered_in_time_or_refused_early(tmp_path, small_tokenizer_dir):
    tok = ModelTokenizer(small_tokenizer_dir)
    engine = make_engine(slowed(tiny_backend(tmp_path, tok.tokenizer.get_vocab_size(), NUM_BLOCKS)), tok, NUM_BLOCKS,
                         max_seqs=2, max_waiting=256)
    engine.start()
    try:
        rt = engine.load_catalog(metatool_trie(tok, first=30))
        assert rt.ready.wait(120)
        lone = engine.submit(rt, "weather in Paris", 3, timeout=30)
        assert outcome(lone, time.monotonic() + 30) == "done" and engine.service_seconds > 0
        service = engine.service_seconds
        timeout = 3 * service        # about three rounds of max_seqs fit in a deadline: a burst of 24 cannot
        outcomes, refused, lock = [], 0, threading.Lock()
        for i in range(24):
            try:
                seq = engine.submit(rt, f"burst request {i} about the weather", 3, timeout=timeout)
            except QueueFull as e:
                assert "after its deadline" in str(e)
                refused += 1
                continue
            deadline = time.monotonic() + timeout

            def wait(seq=seq, deadline=deadline):
                result = outcome(seq, deadline)
                with lock:
                    outcomes.append(result)
            threading.Thread(target=wait).start()
        time.sleep(timeout + 10 * service)
        with lock:
            done = outcomes.count("done")
            assert set(outcomes) <= {"done", "busy"}, outcomes    # none ran past its deadline, none expired
            assert refused + outcomes.count("busy") > 0 and done >= 2, (done, refused, outcomes)
            assert refused + len(outcomes) == 24
        assert outcome(engine.submit(rt, "weather in Paris", 3, timeout=30), time.monotonic() + 30) == "done"
    finally:
        engine.stop()

"""tooltrie_rpc_total for Discover (issue 29, finding 8): an OK series for answered requests, and deadline
expiries counted as DEADLINE_EXCEEDED (they were counted as CANCELLED)."""
import time

import grpc
import pytest
from prometheus_client import REGISTRY

from decoder_stack import TOOLS, DecoderStack, discover, trie_of, wait_until
from engine_fixtures import paused
from shared.rpc import decoder_pb2 as pb


def count(code):
    return REGISTRY.get_sample_value("tooltrie_rpc_total", {"service": "tooltrie.v1.DecoderService",
                                                            "method": "Discover", "code": code}) or 0.0


def test_discover_outcomes_by_code(tmp_path, small_tokenizer_dir, redis_url):
    s = DecoderStack(tmp_path, small_tokenizer_dir, redis_url)
    try:
        s.store.publish("demo", trie_of(s.tok, TOOLS[:10]))
        s.start()
        ok, deadline, cancelled = count("OK"), count("DEADLINE_EXCEEDED"), count("CANCELLED")
        discover(s.stub(), catalog="demo", intent="weather", k=2)
        assert count("OK") == ok + 1
        with paused(s.engine):   # nothing runs: the next request is accepted, then waits past its deadline
            call = s.stub().Discover(pb.DiscoverRequest(catalog="demo", intent="slow", k=2), timeout=1.0)
            assert next(call).HasField("accepted")
            with pytest.raises(grpc.RpcError) as err:
                list(call)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(lambda: count("DEADLINE_EXCEEDED") == deadline + 1, 10, "the expiry counted")
        time.sleep(0.3)
        assert count("DEADLINE_EXCEEDED") == deadline + 1 and count("CANCELLED") == cancelled
    finally:
        s.close()

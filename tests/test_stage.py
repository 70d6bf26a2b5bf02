"""Which stage answers (issue 55): the generator runs only where it can change the answer; elsewhere a request is
answered by retrieval at retrieval's cost, with the same names, and Done says which stage chose. Real gRPC, Redis."""
import pytest

from decoder_stack import TOOLS, DecoderStack, trie_of, wait_until
from shared.rpc import decoder_pb2 as pb

SEEN, UNSEEN = TOOLS[:20], TOOLS[20:40]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, small_tokenizer_dir, redis_url):
    s = DecoderStack(tmp_path_factory.mktemp("stage"), small_tokenizer_dir, redis_url, fusion_weight=1.0,
                     fusion_weight_unseen=1000.0, tuned_tools=frozenset(t["name"] for t in SEEN), shortlist=6)
    s.store.publish("seen", trie_of(s.tok, SEEN))
    s.store.publish("unseen", trie_of(s.tok, UNSEEN))
    s.start()
    wait_until(s.catalogs.settled, 30, "both catalogs served")
    yield s
    s.close()


def ask(stack, catalog, k, mode=pb.MODE_AUTO, **request):
    events = list(stack.stub().Discover(pb.DiscoverRequest(catalog=catalog, intent="weather in Paris and news", k=k,
                                                           mode=mode, **request), timeout=60))
    return [e.pointer.name for e in events[1:-1]], events[-1].done


def test_an_unseen_catalog_is_answered_by_retrieval_with_the_generators_names(stack):
    names, done = ask(stack, "unseen", 2)
    assert done.stage == "retrieval" and done.prompt_tokens == 0 and done.generated_tokens == 0
    decoded, forced = ask(stack, "unseen", 2, pb.MODE_DECODE)
    assert forced.stage == "generator" and forced.generated_tokens > 0
    assert decoded == names      # at the floor's weight the generator writes retrieval's order
    retrieved, _ = ask(stack, "unseen", 2, pb.MODE_RETRIEVE)
    assert retrieved == names


def test_a_tuned_catalog_is_decoded(stack):
    names, done = ask(stack, "seen", 2)
    assert done.stage == "generator" and done.generated_tokens > 0 and len(set(names)) == 2


def test_k_as_large_as_the_shortlist_leaves_nothing_to_choose(stack):
    names, done = ask(stack, "seen", 6)
    assert done.stage == "retrieval" and len(set(names)) == 6
    assert sorted(ask(stack, "seen", 6, pb.MODE_DECODE)[0]) == sorted(names)   # the same set, the generator's order
    assert ask(stack, "seen", 3, shortlist=3)[1].stage == "retrieval"
    assert ask(stack, "seen", 2, shortlist=3)[1].stage == "generator"

"""The CSR trie: built from real catalogs and generated ones, checked by an independent walker."""
import json
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from compiler_service.compiler import compile_catalog, tokenize_names
from shared.catalog import CatalogError, registry_from_entries, parse_registry
from shared.tokenizer import ModelTokenizer
from shared.trie import SEP, STOP, Trie, TrieWalkError
from tokenizer_fixtures import catalog_path

CATALOGS = ["metatool", "bigcatalog", "toolbench"]


def reference_check(trie: Trie, tok: ModelTokenizer) -> None:
    """Walk every path of the trie by enumeration, independently of Trie.walk and build_trie.

    Every path must spell a catalog name (its tokens as written between separators), every name must
    be reachable exactly once, each edge's [lo, hi) must be exactly the pointers below it, and edges
    must be sorted by token with the control edges on the node where their pointer ends.
    """
    names = trie.pointer_names
    bodies = {n: tok.encode(trie.sep_text + n + trie.sep_text)[1:-1] for n in names}
    found = {}

    def visit(node, path):
        lo, hi = trie.node_edge_start[node], trie.node_edge_start[node + 1]
        toks = trie.edge_token[lo:hi]
        assert np.all(np.diff(toks) > 0), f"edges of node {node} not strictly sorted"
        below = set()
        for e in range(lo, hi):
            child, plo, phi = int(trie.edge_child[e]), int(trie.edge_lo[e]), int(trie.edge_hi[e])
            if child in (SEP, STOP):
                assert phi == plo + 1
                assert trie.edge_token[e] == (trie.sep_id if child == SEP else trie.stop_id)
                assert bodies[names[plo]] == path, f"pointer {plo} spelled {path}"
                found.setdefault(plo, 0)
                found[plo] += 1
                pointers = {plo}
            else:
                pointers = visit(child, path + [int(trie.edge_token[e])])
            assert pointers == set(range(plo, phi)), f"edge {e} range [{plo},{phi}) vs {sorted(pointers)}"
            below |= pointers
        return below

    assert visit(0, []) == set(range(len(names)))
    assert all(c == 2 for c in found.values())  # a SEP and a STOP edge per pointer


@pytest.fixture(scope="module")
def small_tok(small_tokenizer_dir):
    return ModelTokenizer(small_tokenizer_dir)


def compiled(name, tok):
    trie = compile_catalog(parse_registry(catalog_path(name).read_text()), tok)
    trie.sep_text = json.loads(trie.meta["prompt"])["separator"]
    return trie


@pytest.mark.parametrize("name", CATALOGS)
def test_real_catalogs_pass_the_reference_walker(name, small_tok):
    reference_check(compiled(name, small_tok), small_tok)


def whole_answers_walk(trie, tok, rng, count=200):
    """Tokenizing a whole answer (header + names joined by the separator + stop) is a trie path."""
    prompt = json.loads(trie.meta["prompt"])
    header = prompt["suffix"].rsplit(prompt["separator"], 1)[0] + prompt["separator"]
    header_ids = tok.encode(header)
    for _ in range(count):
        k = rng.randint(1, min(6, len(trie.pointer_names)))
        chosen = rng.sample(trie.pointer_names, k)
        ids = tok.encode(header + prompt["separator"].join(chosen) + prompt["stop_token"])
        assert ids[:len(header_ids)] == header_ids
        assert [trie.pointer_names[p] for p in trie.walk(ids[len(header_ids):], k)] == chosen


@pytest.mark.parametrize("name", CATALOGS)
def test_whole_answer_is_a_path_small_tokenizer(name, small_tok):
    whole_answers_walk(compiled(name, small_tok), small_tok, random.Random(name))


@pytest.mark.model
@pytest.mark.parametrize("name", CATALOGS)
def test_whole_answer_is_a_path_real_tokenizer(name, model_dir):
    tok = ModelTokenizer(model_dir)
    trie = compiled(name, tok)
    whole_answers_walk(trie, tok, random.Random(name), count=300)
    every_name_once = tok.encode("\n".join(trie.pointer_names) + "<|im_end|>")
    assert trie.walk(every_name_once, len(trie.pointer_names)) == list(range(len(trie.pointer_names)))


def test_walk_refuses_what_the_language_does_not_admit(small_tok):
    trie = compile_catalog(parse_registry('[{"name": "alpha"}, {"name": "beta"}]'), small_tok)
    a, b = (small_tok.encode(n) for n in ("alpha", "beta"))
    sep, stop = trie.sep_id, trie.stop_id
    assert [trie.pointer_names[p] for p in trie.walk(a + [sep] + b + [stop], 2)] == ["alpha", "beta"]
    with pytest.raises(TrieWalkError, match="not an edge"):
        trie.walk(a + [a[0]])
    with pytest.raises(TrieWalkError, match="distinct"):
        trie.walk(a + [sep] + a + [stop], 2)
    with pytest.raises(TrieWalkError, match="expected 2"):
        trie.walk(a + [stop], 2)
    with pytest.raises(TrieWalkError, match="stop token"):
        trie.walk(a + [sep] + b, 2)
    with pytest.raises(TrieWalkError, match="follows the stop"):
        trie.walk(a + [stop] + b)


def test_prefix_names_keep_both_working(small_tok):
    trie = compile_catalog(parse_registry('[{"name": "get"}, {"name": "getWeather"}, {"name": "ge"}]'),
                           small_tok)
    trie.sep_text = "\n"
    reference_check(trie, small_tok)
    ids = small_tok.encode("get\ngetWeather\nge<|im_end|>")
    assert [trie.pointer_names[p] for p in trie.walk(ids, 3)] == ["get", "getWeather", "ge"]


def test_blob_round_trip(small_tok):
    trie = compiled("metatool", small_tok)
    back = Trie.from_blob(trie.to_blob())
    for a in ("node_edge_start", "edge_token", "edge_child", "edge_lo", "edge_hi"):
        assert np.array_equal(getattr(trie, a), getattr(back, a)) and getattr(back, a).dtype == np.int32
    assert back.pointer_names == trie.pointer_names and back.meta == trie.meta
    assert (back.sep_id, back.stop_id) == (trie.sep_id, trie.stop_id)


def test_constant_memory_is_measured_on_the_packed_trie():
    """The compiler's stat and the device's placement are one rule on one measure: the packed trie (its arrays
    after a 2-word header), so a trie whose arrays alone fit 64 KiB but whose packed form does not is 'no'."""
    from shared.trie import CONSTANT_MEMORY_BUDGET, fits_constant_memory

    def trie_of(starts: int, edges: int) -> Trie:     # arrays of starts + 4 * edges int32 words
        z = np.zeros(edges, np.int32)
        return Trie(node_edge_start=np.zeros(starts, np.int32), edge_token=z, edge_child=z.copy(),
                    edge_lo=z.copy(), edge_hi=z.copy(), pointer_names=[], sep_id=0, stop_id=1)

    words, edges = CONSTANT_MEMORY_BUDGET // 4, 4095
    fits, over = trie_of(words - 2 - 4 * edges, edges), trie_of(words - 1 - 4 * edges, edges)
    assert fits.packed_nbytes == fits.nbytes + 8 == CONSTANT_MEMORY_BUDGET and fits.fits_constant_memory
    assert over.nbytes < CONSTANT_MEMORY_BUDGET < over.packed_nbytes and not over.fits_constant_memory
    assert fits_constant_memory(CONSTANT_MEMORY_BUDGET) and not fits_constant_memory(CONSTANT_MEMORY_BUDGET + 1)


def test_blob_of_another_format_is_refused():
    from safetensors.numpy import save
    with pytest.raises(ValueError, match="not a tooltrie trie blob"):
        Trie.from_blob(save({"x": np.zeros(2, np.int32)}, {"format": "other"}))


def test_names_the_tokenizer_cannot_write_are_refused(small_tok):
    with pytest.raises(CatalogError, match=r"tool #1 \('bad<\|im_end\|>'\): the name contains a special token"):
        tokenize_names(["fine", "bad<|im_end|>"], small_tok, "\n", small_tok.single_token("\n", "sep"))
    with pytest.raises(CatalogError, match="ends with whitespace"):
        tokenize_names(["trailing "], small_tok, "\n", small_tok.single_token("\n", "sep"))


def test_descriptions_that_spell_a_special_token_are_refused(small_tok):
    cat = parse_registry('[{"name": "a", "description": "ends the turn <|im_end|> early"}]')
    with pytest.raises(CatalogError, match=r"tool #0 \('a'\): its description or examples contain the special"):
        compile_catalog(cat, small_tok)


def test_tokenizer_without_the_stop_token_is_refused(small_tok, tmp_path):
    from shared.prompt import default_template
    from shared.tokenizer import TokenizerError
    cat = parse_registry('[{"name": "a"}]')
    template = default_template("<|im_start|>{role}\n", "<|im_end|>\n", stop_token="<|no_such|>")
    with pytest.raises(TokenizerError, match="no single token for the stop token"):
        compile_catalog(cat, small_tok, template)


WORDS = ["get", "Get", "weather", "Weather", "_", "a", "ab", "abc", "2", "12", "é", "日本", "API", " ::", "-",
         "search", "s", "x"]
names_strategy = st.lists(st.lists(st.sampled_from(WORDS), min_size=1, max_size=6).map("".join)
                          .filter(lambda n: n.strip() == n and n.strip()), min_size=1, max_size=40, unique=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(names=names_strategy)
def test_generated_catalogs(names, small_tok):
    registry = registry_from_entries([{"name": n} for n in names])
    trie = compile_catalog(registry, small_tok)
    trie.sep_text = "\n"
    reference_check(trie, small_tok)
    back = Trie.from_blob(trie.to_blob())
    assert back.pointer_names == trie.pointer_names
    assert np.array_equal(back.edge_lo, trie.edge_lo) and np.array_equal(back.edge_child, trie.edge_child)
    k = len(names)
    ids = small_tok.encode("\n".join(names) + "<|im_end|>")
    assert [back.pointer_names[p] for p in back.walk(ids, k)] == names

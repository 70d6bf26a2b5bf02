"""The shortlist prompt's tokens: joined from each tool's line tokenized alone, they are the whole text's.

The decoder tokenizes every tool's line once, when a catalog version is loaded, and joins lines per request
(and `tune` builds its prompts the same way), so the joined tokens must be what tokenizing the whole prompt
text gives, or a tuned model would be served other tokens than the text it was trained on. Checked with the
real SmolLM2 tokenizer (where `make model` has run) and the suite's small byte-level BPE, on random shortlists
of every shared catalog; and a description that spells a placeholder stays text.
"""
from __future__ import annotations

import json
import random

import pytest

from shared.catalog import parse_registry
from shared.prompt import default_template, tool_line
from shared.tokenizer import ModelTokenizer
from tokenizer_fixtures import catalog_path

SETS = ["metatool", "toolbench", "bigcatalog"]


def whole_text_ids(template, tok, names, descriptions, intent, k) -> list[int]:
    """The prompt's text built whole, then tokenized (the intent as user text): what the joined tokens must be."""
    lines = "\n".join(tool_line(n, d, template.description_chars) for n, d in zip(names, descriptions))
    before, after = template.suffix.replace("{k}", str(k)).split("{intent}", 1)
    return tok.encode(before.replace("{tools}", lines)) + tok.encode_plain(intent) + tok.encode(after)


@pytest.fixture(scope="module", params=["smollm2", "small"])
def tok(request, small_tokenizer_dir):
    if request.param == "small":
        return ModelTokenizer(small_tokenizer_dir)
    return ModelTokenizer(request.getfixturevalue("model_dir"))


@pytest.mark.parametrize("name", SETS)
def test_joined_lines_are_the_whole_texts_tokens(tok, name):
    template = default_template(*tok.chat_format())
    tools = parse_registry(catalog_path(name).read_text()).tools
    queries = [json.loads(line)["query"] for line in (catalog_path(name).parent / "dev_queries.jsonl").open()]
    rng = random.Random(0)
    for intent in queries[:60]:
        picked = rng.sample(tools, 20)
        names, descriptions = [t.name for t in picked], [t.description for t in picked]
        k = rng.randint(1, 3)
        lines = [tok.encode(template.line(n, d)) for n, d in zip(names, descriptions)]
        want = whole_text_ids(template, tok, names, descriptions, intent, k)
        assert template.request_ids(tok, lines, intent, k) == want, intent
        assert template.request_ids(tok, lines, "", k, tok.encode_plain(intent)) == want, intent   # given tokens: P120


def test_a_description_that_spells_a_placeholder_stays_text(small_tokenizer_dir):
    """A registry is its owner's text: "{intent}" or "{k}" in a description must not move the user's intent into
    the tool list or fill in k."""
    tok = ModelTokenizer(small_tokenizer_dir)
    template = default_template(*tok.chat_format())
    tricky = [("Echo", "repeats {intent} back, {k} times"), ("Weather", "the forecast")]
    lines = [tok.encode(template.line(n, d)) for n, d in tricky]
    text = tok.decode(template.request_ids(tok, lines, "will it rain?", 2))
    assert "- Echo: repeats {intent} back, {k} times\n- Weather: the forecast" in text
    assert text.count("will it rain?") == 1 and text.index("will it rain?") > text.index("the forecast")
    assert "exactly 2 tool name(s)" in text


def test_a_version_tokenizes_its_lines_at_load(small_tokenizer_dir):
    """CatalogRuntime.request_ids is the whole text's tokens, from every tool's line tokenized when the version
    is loaded (P86: a version's first request costs what any other does)."""
    from compiler_service.compiler import compile_catalog
    from decoder_service.engine.catalog_runtime import CatalogRuntime
    from decoder_service.retrieval.host import Retriever, bm25_index
    tok = ModelTokenizer(small_tokenizer_dir)
    trie = compile_catalog(parse_registry(catalog_path("metatool").read_text()), tok)
    rt = CatalogRuntime.from_trie(trie, Retriever(bm25_index(trie), len(trie.pointer_names)), tok, 16)
    assert "lines" in vars(rt)          # built by from_trie, before any request
    flat, offsets = rt.lines
    assert len(offsets) == len(trie.pointer_names) + 1 and offsets[-1] == len(flat)
    for tools in ([7, 3, 150], [0], list(range(len(trie.pointer_names)))[::-10]):
        names = [trie.pointer_names[i] for i in tools]
        assert rt.request_ids(tools, "book a table for two", 2) == whole_text_ids(
            rt.template, tok, names, [rt.descriptions[i] for i in tools], "book a table for two", 2)

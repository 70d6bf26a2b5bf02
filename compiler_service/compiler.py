"""Registry -> trie: tokenize every tool name in the context the model writes it, build the CSR trie.

A name is tokenized between two separators (how it appears in an answer: after the assistant header or
after the previous name), so what the trie admits is what the model would naturally write. A name that
does not come back unchanged from its tokens, merges with the separator, or contains a control token is
refused with a CatalogError naming the tool.
"""
from __future__ import annotations

import time

from shared.bm25 import Bm25Index, tool_terms
from shared.catalog import CatalogError, Registry
from shared.prompt import PromptTemplate, default_template
from shared.tokenizer import ModelTokenizer
from shared.trie import Trie, build_trie


def tokenize_names(names: list[str], tok: ModelTokenizer, separator: str, sep_id: int) -> list[list[int]]:
    """Each name's token ids as written between two separators; refuses names that cannot be."""
    contexts = tok.tokenizer.encode_batch([separator + n + separator for n in names], add_special_tokens=False)
    bodies = [c.ids[1:-1] for c in contexts]
    decoded = tok.tokenizer.decode_batch(bodies, skip_special_tokens=False)
    special = tok.special_ids
    for i, (name, ctx, body, text) in enumerate(zip(names, contexts, bodies, decoded)):
        where = f"tool #{i} ({name[:80]!r})"
        if name != name.rstrip():
            raise CatalogError(f"{where}: the name ends with whitespace, which merges with the separator")
        if len(ctx.ids) < 2 or ctx.ids[0] != sep_id or ctx.ids[-1] != sep_id:
            raise CatalogError(f"{where}: the name merges with the separator {separator!r} when tokenized")
        if not body:
            raise CatalogError(f"{where}: the name tokenizes to nothing")
        if special.intersection(body):
            raise CatalogError(f"{where}: the name contains a special token of the tokenizer")
        if text != name:
            raise CatalogError(f"{where}: the tokenizer cannot represent the name exactly "
                               f"(it comes back as {text[:80]!r})")
    return bodies


def check_prompt_text(registry: Registry, tok: ModelTokenizer) -> None:
    """Refuse descriptions and examples that spell a special token: in the prompt it would act as one
    (a literal "<|im_end|>" in a description would end the system turn)."""
    specials = [tok.tokenizer.id_to_token(i) for i in sorted(tok.special_ids)]
    for i, t in enumerate(registry.tools):
        for text in (t.description, *t.examples):
            hit = next((s for s in specials if s in text), None)
            if hit:
                raise CatalogError(f"tool #{i} ({t.name!r}): its description or examples contain the special "
                                   f"token {hit!r}")


def compile_catalog(registry: Registry, tok: ModelTokenizer, template: PromptTemplate | None = None) -> Trie:
    """Compile a validated registry into a catalog version: the names' trie, whose metadata and extra arrays hold
    everything else the decoder needs (descriptions, examples, schemas, the BM25 index, the prompt)."""
    started = time.perf_counter()
    check_prompt_text(registry, tok)
    if template is None:
        template = default_template(*tok.chat_format())
    sep_id = tok.single_token(template.separator, "separator")
    stop_id = tok.single_token(template.stop_token, "stop token")
    names = registry.names
    trie = build_trie(tokenize_names(names, tok, template.separator, sep_id), names, sep_id, stop_id)
    by_name = {t.name: t for t in registry.tools}
    tools = [by_name[n] for n in trie.pointer_names]   # in pointer-id order, as the decoder indexes them
    index = Bm25Index.build([tool_terms(t.name, t.description, t.examples) for t in tools])
    trie.extra.update({f"bm25_{a}": getattr(index, a) for a in Bm25Index.ARRAYS})
    trie.meta.update({
        "descriptions": [t.description for t in tools],
        "examples": [list(t.examples) for t in tools],
        "input_schemas": [t.input_schema for t in tools],
        "bm25_terms": index.terms,
        "content_hash": registry.content_hash_with(template, tok.hash),
        "tokenizer_hash": tok.hash,
        "prompt": template.to_json(),
        "compile_ms": round((time.perf_counter() - started) * 1e3, 3),
    })
    return trie

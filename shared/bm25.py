"""BM25 over tool names and descriptions: built by the compiler at publish time, scored by the decoder.

Names are split where a person would read words (camelCase, `_`, `-`, `::`, digits), so "getWeather" and
"weather_forecast" share the term "weather". The index stores each posting's BM25 weight precomputed
(idf times the saturated term frequency), so a query's score is one sum per posting of its terms.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
from numba import njit

K1, B = 1.2, 0.75
NAME_BOOST = 2  # a name's terms count this many times: a name says what a tool is in few words
STOPWORDS = frozenset(
    "a an and any are as at be by can could do does for from get give how i if in into is it its let me my "
    "of on or please show some tell that the their them there these this to use using want was we what "
    "when where which who will with would you your".split())
_CAMEL = re.compile(r"(?<=[a-z])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])|(?<=[A-Za-z])(?=[0-9])|(?<=[0-9])(?=[A-Za-z])")
_WORD = re.compile(r"[^\W_]+")


def terms(text: str) -> list[str]:
    """Lower-cased word terms of a text, camelCase split, stopwords dropped, a plural's final s cut."""
    text = _CAMEL.sub(" ", text)
    out = []
    for w in _WORD.findall(text.casefold()):
        if w in STOPWORDS:
            continue
        if len(w) > 3 and w.endswith("s") and not w.endswith("ss"):
            w = w[:-1]
        out.append(w)
    return out


def tool_terms(name: str, description: str, examples: tuple[str, ...] | list[str] = ()) -> list[str]:
    """A tool's BM25 document: its name's terms (NAME_BOOST times), its description's, and those of the
    requests it answers (its examples)."""
    return terms(name) * NAME_BOOST + terms(description) + [w for x in examples for w in terms(x)]


@dataclass
class Bm25Index:
    terms: list[str]              # sorted vocabulary
    term_start: np.ndarray        # int32 [terms + 1]: postings of term t are [term_start[t], term_start[t + 1])
    doc: np.ndarray               # int32 [postings]: tool (pointer) id
    weight: np.ndarray            # float32 [postings]: idf * tf (k1 + 1) / (tf + k1 (1 - b + b dl / avgdl))

    lookup: dict[str, int] = field(init=False, repr=False, compare=False)   # term -> id

    ARRAYS = ("term_start", "doc", "weight")

    def __post_init__(self):
        """The term lookup is built and the postings' sum compiled with the index, not at its first query (numba
        compiles on a first call: ~150 ms even from its disk cache): a version's first request then costs what
        the others do."""
        self.lookup = {t: i for i, t in enumerate(self.terms)}
        _accumulate(np.empty(0, np.int32), self.term_start, self.doc, self.weight, np.zeros(0, np.float32),
                    np.empty(0, np.int32))

    @classmethod
    def build(cls, docs: list[list[str]]) -> "Bm25Index":
        """The index of documents given as term lists (document i is tool i)."""
        lengths = np.asarray([len(d) for d in docs], np.float64)
        avg = max(lengths.mean(), 1.0) if len(docs) else 1.0
        postings: dict[str, dict[int, int]] = {}
        for i, d in enumerate(docs):
            for t in d:
                postings.setdefault(t, {}).setdefault(i, 0)
                postings[t][i] += 1
        vocab = sorted(postings)
        start, doc, weight = [0], [], []
        n = len(docs)
        for t in vocab:
            ids = sorted(postings[t])
            tf = np.asarray([postings[t][i] for i in ids], np.float64)
            idf = np.log(1.0 + (n - len(ids) + 0.5) / (len(ids) + 0.5))
            norm = K1 * (1.0 - B + B * lengths[ids] / avg)
            doc.extend(ids)
            weight.extend(idf * tf * (K1 + 1.0) / (tf + norm))
            start.append(len(doc))
        return cls(vocab, np.asarray(start, np.int32), np.asarray(doc, np.int32), np.asarray(weight, np.float32))

    def scores(self, query: str, n_docs: int) -> np.ndarray:
        """float32 [n_docs]: each tool's BM25 score for the query (0 where no term matches)."""
        return self._accumulated(query, n_docs)[0]

    def matched(self, query: str, n_docs: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, scores) of the tools with a nonzero score for the query, in the order the postings first
        touch them (the rest score 0): what a scorer over a large catalog needs, without a pass over it."""
        out, touched = self._accumulated(query, n_docs)
        return touched.copy(), out[touched]

    def _accumulated(self, query: str, n_docs: int) -> tuple[np.ndarray, np.ndarray]:
        """(every tool's score, the ids of the tools the query's postings touched)."""
        term_ids = np.asarray(sorted({self.lookup.get(t, -1) for t in terms(query)} - {-1}), np.int32)
        out, touched = np.zeros(n_docs, np.float32), np.empty(n_docs, np.int32)
        n = _accumulate(term_ids, self.term_start, self.doc, self.weight, out, touched)
        return out, touched[:n]

    def check(self, n_docs: int) -> None:
        """Refuse an index whose arrays do not describe postings of n_docs tools (a corrupt blob)."""
        s = self.term_start
        if len(s) != len(self.terms) + 1 or s[0] != 0 or s[-1] != len(self.doc) or np.any(np.diff(s) < 0):
            raise ValueError("BM25 index: term offsets are not a CSR over its postings")
        if len(self.weight) != len(self.doc) or (len(self.doc) and (self.doc.min() < 0 or self.doc.max() >= n_docs)):
            raise ValueError("BM25 index: a posting names a tool outside the catalog")
        if not np.all(np.isfinite(self.weight)):
            raise ValueError("BM25 index: a weight is not finite")


@njit(cache=True)
def _accumulate(term_ids, term_start, doc, weight, out, touched):
    """Sum each matched term's postings into out, terms in ascending id order (a fixed order), listing each
    tool in touched the first time a posting reaches it (weights are positive, so an untouched tool's score is
    still 0); returns how many were touched."""
    n = 0
    for t in term_ids:
        for p in range(term_start[t], term_start[t + 1]):
            d = doc[p]
            if out[d] == 0.0:
                touched[n] = d
                n += 1
            out[d] += weight[p]
    return n

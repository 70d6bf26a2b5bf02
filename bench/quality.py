"""Answer quality: recall@k and exact-set of the retrievers and of tooltrie's answers, in one run.

    .venv/bin/python -m bench quality [--split validation] [--sample 100] [--weights 1000] [--backend auto]

For each data set of ../shared/data (MetaTool, StableToolBench, Seal-Tools), on the fixed validation split
(shared/dataset.py; `--split train` or `--split selection` to choose settings, never validation), its catalog
published with the training split's single-tool queries as examples (shared/dataset.registry; on another split,
less the queries measured): BM25 top-k, the dense encoder's top-k, the vote of the tools' requests nearest the
query (k nearest neighbours), the fusion of the three (the decoder's retriever), the share of gold tools within the
shortlist (the ceiling of any answer drawn from it), and tooltrie's answers through the engine (the shortlist in
the prompt, the generator constrained to it, the answer's order fused with retrieval at each --weights value).
k is each query's number of gold tools. Beside them, in the same run (`--unseen`, default loo), each data set as a
catalog nobody has seen (leave one data set out): published without examples, answered by BM25, by the dense and
fused retrievers with the base encoder and with the service encoder's counterpart trained without that set, and by
tooltrie at the unseen fusion weight and with the reader reranking those shortlists as the service does (a reader
that never saw that set); each query's answers are kept in the results. Prints a markdown table with
rows per k and writes bench/results/quality_<device>.json. --sample N takes every m-th query so that N remain (0:
all).
"""
from __future__ import annotations

import itertools
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from compiler_service.compiler import compile_catalog
from bench.common import device_label
from decoder_service.encoder import load_encoder
from shared.config import DEFAULT_ENCODER_DIR as BASE_ENCODER_DIR
from decoder_service.encoder.tuned import trained_on, without
from decoder_service.engine.fusion import tuned_tools
from decoder_service.engine.engine import DecodeEngine, EngineConfig
from decoder_service.gpu.device import resolve_backend
from decoder_service.model.backend import device_name, make_backend, weights_dtype
from decoder_service.model.config import ModelConfig
from decoder_service.model.kv_pool import KVPoolSpec
from decoder_service.model.weights import load_weights
from decoder_service.reader import Reader, trained_sets
from decoder_service.retrieval.config import DENSE_WEIGHT, SHORTLIST, VOTE_WEIGHT
from decoder_service.retrieval.host import Retriever, bm25_index, intent_parts, top_n
from decoder_service.retrieval.vectors import computed_vectors
from shared import dataset
from shared.catalog import parse_registry
from shared.config import DEFAULT_MODEL_DIR, REPO_ROOT, Settings
from shared.tokenizer import ModelTokenizer


def sample(queries: list, n: int) -> list:
    """Every m-th query so that about n remain (a fixed, spread-out sample); all when n is 0."""
    if not n or n >= len(queries):
        return queries
    return queries[::-(-len(queries) // n)]


def score(answers: list[list[str]], queries: list) -> dict:
    """recall@k (gold tools found over gold tools) and exact-set (answers equal to the gold set)."""
    hits = sum(len(set(a) & set(q.tools)) for a, q in zip(answers, queries))
    gold = sum(len(q.tools) for q in queries)
    exact = sum(set(a) == set(q.tools) for a, q in zip(answers, queries))
    return {"recall": hits / gold, "exact": exact / len(queries)}


def groups(q, new: frozenset[str]) -> list[str]:
    """A query's rows besides "all": its k, and with tools held out, whether a gold tool is one of them."""
    k = str(len(q.tools)) if len(q.tools) < 4 else "4+"
    return [k] + ([("new tool" if new.intersection(q.tools) else "known tools")] if new else [])


class Harness:
    """The model, its engine per fusion weight, and the encoder: loaded once for every data set."""

    def __init__(self, model_dir, encoder_dir, backend: str, dense_weight: float = DENSE_WEIGHT,
                 vote_weight: float = VOTE_WEIGHT, reader_dir: str = ""):
        self.kind = resolve_backend(backend)
        self.reader_dir = Path(reader_dir) if reader_dir else None
        cfg = ModelConfig.from_dir(model_dir)
        self.spec = KVPoolSpec.from_tokens(65536)
        self.backend = make_backend(cfg, load_weights(model_dir, cfg, weights_dtype(self.kind, cfg)), self.spec,
                                    self.kind)
        self.cfg, self.tok = cfg, ModelTokenizer(model_dir)
        self.encoder = load_encoder(encoder_dir, self.kind)
        self.dense_weight, self.vote_weight = dense_weight, vote_weight
        self.tuned_tools = tuned_tools(model_dir)
        self.encoders = {}   # other encoders (the leave-one-out rows'), by folder
        self.readers = {}    # the readers of the leave-one-out rows, by folder

    def engine(self, weight: float | None) -> DecodeEngine:
        """An engine answering at `weight` whatever the catalog, or (None) at the service's settings: the tuned
        weight for a catalog the model was tuned on, the unseen one for another (engine.fusion)."""
        settings = Settings()
        config = (EngineConfig(fusion_weight=weight, line_kv=settings.line_kv) if weight is not None else EngineConfig(
            fusion_weight=settings.fusion_weight, fusion_weight_unseen=settings.fusion_weight_unseen,
            line_kv=settings.line_kv))
        return DecodeEngine(self.backend, self.tok, self.spec.num_blocks, self.spec.block_size,
                            self.cfg.max_position_embeddings, config, self.tuned_tools)

    def served(self, trie) -> tuple[Retriever, DecodeEngine, object]:
        """(retriever, engine, runtime): one version as the service serves it: its vectors computed now, the
        engine at the service's fusion settings, its prefix warm."""
        vectors, _ = computed_vectors(trie, self.encoder)
        retriever = Retriever(bm25_index(trie), len(trie.pointer_names), vectors, self.encoder, self.dense_weight,
                              self.vote_weight)
        engine = self.engine(None)
        rt = engine.load_catalog(trie, retriever)
        engine.run_until_idle()
        return retriever, engine, rt

    @staticmethod
    def answers(seqs: list) -> list[list[str]]:
        """Each finished request's names, checked to be k distinct ones."""
        out = []
        for seq in seqs:
            answer = [e.name for e in list(seq)[:-1]]
            assert len(answer) == len(set(answer)) == seq.k, f"not k distinct names: {answer}"
            out.append(answer)
        return out

    def decoded(self, engine: DecodeEngine, rt, queries: list, shortlists: list) -> tuple[list, list[int]]:
        """(answers, prompt tokens): each query answered by the engine over its shortlist, in waves of the queue's
        bound."""
        answers, tokens, wave = [], [], engine.config.max_waiting
        for start in range(0, len(queries), wave):
            seqs = [engine.submit(rt, q.text, len(q.tools), shortlist=s)
                    for q, s in zip(queries[start:start + wave], shortlists[start:start + wave])]
            tokens += [len(seq.prompt_ids) for seq in seqs]
            engine.run_until_idle()
            answers += self.answers(seqs)
        return answers, tokens

    def encoder_at(self, model_dir: Path):
        """The encoder in model_dir on this harness's backend, loaded once."""
        key = Path(model_dir).resolve()
        if key == Path(self.encoder.model_dir).resolve():
            return self.encoder
        if key not in self.encoders:
            self.encoders[key] = load_encoder(key, self.kind)
        return self.encoders[key]

    def unseen(self, name: str, split: str, n: int, base_encoder: Path, weight: float | None,
               written: dict[str, list[str]] | None = None) -> dict:
        """Data set `name` as a catalog nobody has seen (leave one data set out): published without examples, its
        queries answered by BM25, by the dense and fused retrievers with the base encoder and with the service's
        encoder's counterpart trained without `name` (decoder_service.encoder.tuned.without; the base itself where
        the service's encoder is the base), and by tooltrie through the engine over the latter's shortlists at
        `weight` (None: no engine). With `written` ({tool: requests} from a writer that never saw `name`,
        tune/writer.py), the same again with those requests published as the tools' examples. Each query's
        answers are kept."""
        queries = sample(dataset.queries(name, split), n)
        tools = json.loads(dataset.catalog_path(name).read_text(encoding="utf-8"))
        encoders = {"base": Path(base_encoder)}
        loo = without(self.encoder.model_dir, name)
        if loo.resolve() != Path(base_encoder).resolve():
            encoders["tuned"] = loo
        lists = self.answered(name, tools, [], queries, encoders, weight, "")
        if written is not None:
            labelled = [dataset.Query(r, (t,)) for t, requests in written.items() for r in requests]
            lists.update(self.answered(name, tools, labelled, queries, encoders, weight, " + written"))
        rows, counts = rows_of(lists, queries)
        return {"set": name, "label": f"{dataset.SETS[name]} unseen", "split": split, "queries": len(queries),
                "by_k": dict(sorted(counts.items())), "tools": len(tools), "examples": 0,
                "written": sum(map(len, written.values())) if written else 0,
                "encoders": {label: {"folder": Path(d).name, "trained_on": sorted(trained_on(d))}
                             for label, d in encoders.items()},
                "selector_trained_on_it": bool(self.tuned_tools & {t["name"] for t in tools}), "rows": rows,
                "answers": [{"query": q.text, "gold": list(q.tools), **{m: a[i] for m, a in lists.items()}}
                            for i, q in enumerate(queries)]}

    def answered(self, name: str, tools: list[dict], labelled: list, queries: list, encoders: dict[str, Path],
                 weight: float | None, suffix: str) -> dict[str, list]:
        """Each method's answers over the catalog published with `labelled` as examples: BM25, dense and fused
        per encoder, and tooltrie at `weight` over the last encoder's shortlists; method names end in `suffix`."""
        trie = compile_catalog(parse_registry(dataset.published(tools, labelled)), self.tok)
        trie.meta.update(name=name + suffix, version=1)
        names, index = trie.pointer_names, bm25_index(trie)
        lists = {f"bm25{suffix}": [[names[i] for i in top_n(index.scores(q.text, len(names)), len(q.tools))]
                                   for q in queries]}
        for label, model_dir in encoders.items():
            encoder = self.encoder_at(model_dir)
            vectors, _ = computed_vectors(trie, encoder)
            retriever = Retriever(index, len(names), vectors, encoder, self.dense_weight, self.vote_weight)
            dense, fused, shortlists = [], [], []
            for q in queries:
                cos = (vectors.tools @ encoder.encode(intent_parts(q.text)).T).max(axis=1)
                dense.append([names[i] for i in top_n(cos.astype(np.float32), len(q.tools))])
                shortlists.append(retriever.shortlist(q.text, max(SHORTLIST, len(q.tools))))
                fused.append([names[i] for i in shortlists[-1].ids[:len(q.tools)]])
            lists[f"dense ({label}){suffix}"], lists[f"fused ({label}){suffix}"] = dense, fused
        if weight is not None:   # the service's encoder's counterpart: the last retriever
            engine = self.engine(weight)
            rt = engine.load_catalog(trie, retriever)
            engine.run_until_idle()
            lists[f"tooltrie w={rt.fusion_weight:g} ({label}){suffix}"] = self.decoded(engine, rt, queries,
                                                                                       shortlists)[0]
        reader = self.reader_without(name)
        if reader is None and self.reader_dir is not None:
            print(f"{name}: no reader that never saw it beside {self.reader_dir} (`python -m tune.writer --folds "
                  "both --out var/writers` on a GPU, then `make quality`): no reader row", flush=True)
        if reader is not None:   # what the service answers in MODE_AUTO: the reader over the same shortlists
            lists[f"tooltrie, reader {reader.model_dir.name} ({label}){suffix}"] = [
                [names[i] for i in reader.read(trie, q.text, s, len(q.tools)).ids] for q, s in zip(queries, shortlists)]
        return lists

    def reader_without(self, name: str) -> Reader | None:
        """A reader whose model never saw data set `name`, loaded once: the harness's reader where its writer was
        not trained on it (the untrained base never was), else its leave-one-out counterpart `<reader>-without-
        <name>` (`make quality` merges them from var/writers); None where there is neither."""
        if self.reader_dir is None:
            return None
        folder = self.reader_dir
        if name in trained_sets(folder):
            folder = folder.with_name(f"{folder.name}-without-{name}")
        if not (folder / "model.safetensors").is_file() or name in trained_sets(folder):
            return None
        if folder not in self.readers:
            self.readers[folder] = Reader(folder, self.kind)
        return self.readers[folder]

    def run(self, name: str, split: str, n: int, weights: list[float | None], hold_out: float = 0.0,
            keep_answers: bool = False, sizes: tuple[int, ...] = (SHORTLIST,)) -> dict:
        queries = sample(dataset.queries(name, split), n)
        held = frozenset(q.text for q in queries) if split != "validation" else frozenset()  # never its own example
        new = dataset.held_out([t["name"] for t in json.loads(dataset.catalog_path(name).read_text())], hold_out)
        trie = compile_catalog(parse_registry(dataset.registry(name, held, new)), self.tok)
        trie.meta.update(name=name, version=1)
        started = time.perf_counter()
        vectors, _ = computed_vectors(trie, self.encoder)
        vectors_s = time.perf_counter() - started
        retriever = Retriever(bm25_index(trie), len(trie.pointer_names), vectors, self.encoder, self.dense_weight,
                              self.vote_weight)
        names = trie.pointer_names
        lists = defaultdict(list)
        shortlists = []
        for q in queries:
            k = len(q.tools)
            parts = self.encoder.encode(intent_parts(q.text))
            dense = (vectors.tools @ parts.T).max(axis=1)
            lists["bm25"].append([names[i] for i in top_n(retriever.index.scores(q.text, len(names)), k)])
            lists["dense"].append([names[i] for i in top_n(dense.astype(np.float32), k)])
            votes = retriever.votes(parts, np.ones(len(names), bool))
            lists["requests"].append([names[i] for i in top_n(votes.astype(np.float32), k)])
            s = retriever.shortlist(q.text, max(*sizes, k))
            shortlists.append(s)
            lists["fused"].append([names[i] for i in s.ids[:k]])
            for size in sizes:
                lists[sized("shortlist", size, sizes)].append([names[i] for i in s.ids[:max(size, k)]])
        prompt_tokens = {}
        for w, size in itertools.product(weights, sizes):
            engine = self.engine(w)
            rt = engine.load_catalog(trie, retriever)
            engine.run_until_idle()
            cut = [s.head(max(size, len(q.tools))) for q, s in zip(queries, shortlists)]
            answers, tokens = self.decoded(engine, rt, queries, cut)
            method = sized(f"tooltrie w={rt.fusion_weight:g}", size, sizes)
            lists[method] = answers
            prompt_tokens[method] = round(float(np.mean(tokens)), 1)
        reader = self.reader_without(name)
        if reader is not None:   # the catalog with its examples, as a reader that never saw it would answer
            lists[f"reader {reader.model_dir.name}"] = [
                [names[i] for i in reader.read(trie, q.text, s.head(max(SHORTLIST, len(q.tools))), len(q.tools)).ids]
                for q, s in zip(queries, shortlists)]
        rows, counts = rows_of(lists, queries, new)
        out = {"set": name, "split": split, "queries": len(queries), "by_k": dict(sorted(counts.items())),
               "tools": len(names), "tool_vectors_s": round(vectors_s, 2), "shortlists": list(sizes),
               "prompt_tokens": prompt_tokens, "rows": rows}
        if keep_answers:   # each query's gold, shortlist and every method's answer, to read the misses
            out["answers"] = [{"query": q.text, "gold": list(q.tools), **{m: a[i] for m, a in lists.items()}}
                              for i, q in enumerate(queries)]
        return out


def rows_of(lists: dict[str, list], queries: list, new: frozenset[str] = frozenset()) -> tuple[dict, dict]:
    """(rows, counts): each method's scores over all queries and per group (groups), the shortlists' recall only;
    and the number of queries in each group."""
    rows = {}
    for method, answers in lists.items():
        by_k = defaultdict(list)
        for a, q in zip(answers, queries):
            for g in groups(q, new):
                by_k[g].append((a, q))
        if method.startswith("shortlist"):  # the ceiling: gold within the shortlist (recall only)
            rows[method] = {"all": score(answers, queries)["recall"]}
            continue
        rows[method] = {"all": score(answers, queries),
                        **{g: score([a for a, _ in v], [q for _, q in v]) for g, v in sorted(by_k.items())}}
    counts = defaultdict(int)
    for q in queries:
        for g in groups(q, new):
            counts[g] += 1
    return rows, counts


def sized(method: str, size: int, sizes: tuple[int, ...]) -> str:
    """A method's name at one shortlist size: the name alone where one size is measured, "<name> N=<size>" where
    several are."""
    return method if len(sizes) == 1 else f"{method} N={size}"


def table(results: list[dict]) -> str:
    """One markdown table: a row per set, method and k group."""
    lines = ["| data set | queries | method | k | recall@k | exact-set |", "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        label = r.get("label") or dataset.SETS[r["set"]]
        for method, row in r["rows"].items():
            if method.startswith("shortlist"):
                size = method.partition("N=")[2] or r["shortlists"][0]
                lines.append(f"| {label} | {r['queries']} | gold in the shortlist (top {size}) | all | "
                             f"{row['all']:.3f} | - |")
                continue
            for group, m in row.items():
                n = r["queries"] if group == "all" else r["by_k"][group]
                lines.append(f"| {label} | {n} | {method} | {group} | {m['recall']:.3f} | {m['exact']:.3f} |")
    return "\n".join(lines)


def quality_arguments(p) -> None:
    p.add_argument("--sets", default=",".join(dataset.SETS))
    p.add_argument("--split", default="validation", choices=["train", "selection", "validation"],
                   help="train or selection (within train) to choose settings; never validation")
    p.add_argument("--sample", type=int, default=None, help="queries per set (default: 100 on the CPU, all on a GPU)")
    p.add_argument("--weights", default=None, help="fusion weights, comma-separated (default: the service's "
                   "settings, by whether the model was tuned on the catalog; none: the retrievers alone)")
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--encoder", default=Settings().encoder_dir)
    p.add_argument("--base-encoder", default=str(BASE_ENCODER_DIR), help="the untuned encoder of the unseen rows")
    p.add_argument("--unseen", default="loo", choices=["loo", "only", "none"], help="the unseen rows (each set "
                   "published without examples, leave one data set out) beside the others, alone, or not")
    p.add_argument("--written", type=Path, default=None, help="a folder of written-<set>.json (tune/writer.py): "
                   "the unseen rows again with those requests as the tools' examples")
    p.add_argument("--reader", default=Settings().reader_dir, help="the reader of the unseen rows (its counterpart "
                   "<reader>-without-<set> for a set it was trained on; empty: none)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--hold-out-tools", type=float, default=0.0, help="fraction of each catalog's tools published "
                   "without examples (shared/dataset.held_out), reported apart as new tools")
    p.add_argument("--out", type=Path, default=None, help="the results file (default: "
                   "bench/results/quality_<device>[_<split>][_new_tools].json)")
    p.add_argument("--answers", type=Path, default=None, help="also write each query's gold tools, shortlist and "
                   "answers (JSON lines) to this file")
    p.add_argument("--shortlists", default=str(SHORTLIST), help="tools in the prompt, comma-separated sizes "
                   "(training or selection split only: the service's size is chosen there)")
    p.add_argument("--dense-weight", type=float, default=DENSE_WEIGHT,
                   help="the retrievers' fusion (training split only)")
    p.add_argument("--vote-weight", type=float, default=VOTE_WEIGHT,
                   help="what the nearest requests' vote adds to the fusion (training split only)")


def quality(args) -> None:
    weights = ([] if args.weights == "none" else [float(w) for w in args.weights.split(",")] if args.weights
               else [None])
    sizes = tuple(int(x) for x in args.shortlists.split(","))
    if sizes != (SHORTLIST,) and args.split == "validation":
        raise SystemExit("--shortlists: sizes are chosen on the training or selection split, never validation")
    harness = Harness(args.model, args.encoder, args.backend, args.dense_weight, args.vote_weight, args.reader)
    n = args.sample if args.sample is not None else (0 if harness.kind == "cuda" else 100)
    started = time.perf_counter()
    results, unseen = [], []
    for name in args.sets.split(","):
        if args.unseen != "only":
            results.append(harness.run(name, args.split, n, weights, args.hold_out_tools, bool(args.answers), sizes))
            print(f"{name}: {results[-1]['queries']} queries, {time.perf_counter() - started:.0f} s", flush=True)
        if args.unseen != "none":   # a selector never shown the set gets the unseen weight (engine.fusion)
            written = (json.loads((args.written / f"written-{name}.json").read_text(encoding="utf-8"))
                       if args.written else None)
            unseen.append(harness.unseen(name, args.split, n, Path(args.base_encoder),
                                         Settings().fusion_weight_unseen if weights else None, written))
            print(f"{name} unseen: {unseen[-1]['queries']} queries, {time.perf_counter() - started:.0f} s",
                  flush=True)
    device = device_label(harness.kind)
    suffix = (("" if args.split == "validation" else f"_{args.split}") + ("_new_tools" if args.hold_out_tools else "")
              + ("_unseen" if args.unseen == "only" else ""))
    out = args.out or REPO_ROOT / "bench" / "results" / f"quality_{device}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.answers:
        args.answers.write_text("".join(json.dumps({"set": r["set"], **a}) + "\n" for r in results
                                        for a in r.pop("answers")))
    out.write_text(json.dumps({"device": device_name(harness.kind), "model": Path(args.model).name,
                               "encoder": harness.encoder.name, "dense_weight": args.dense_weight,
                               "vote_weight": args.vote_weight, "line_kv": Settings().line_kv,
                               "shortlist": list(sizes), "weights": ["service" if w is None else w for w in weights],
                               "hold_out_tools": args.hold_out_tools, "results": results, "unseen": unseen,
                               "seconds": round(time.perf_counter() - started)}, indent=1) + "\n")
    print(table(results + unseen))

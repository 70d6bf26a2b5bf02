"""The benchmark's own pieces that run without a GPU: the command line (`python -m bench` with no command
is the headline run), the query set the issue fixes (469 MetaTool dev queries: the first 279 with k=1 and
all 190 with k=2, in file order), the report, which must render the recorded H200 run exactly as it was
written (tables and ratios come from the JSON alone), and what --merge keeps of an earlier run."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from bench import report
from bench.__main__ import COMMANDS, handler, parse_args
from bench.workload import metatool_queries
from shared.dataset import data_dir

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def test_no_command_is_the_headline_run_and_every_command_has_its_arguments_and_runner():
    args = parse_args(["--shapes", "smollm2-135m", "--workloads", "metatool", "--no-peer"])
    assert args.command == "serve" and args.shapes == "smollm2-135m" and args.no_peer
    assert parse_args([]).command == "serve"
    args = parse_args(["quality", "--sample", "5", "--weights", "none"])
    assert args.command == "quality" and args.sample == 5 and args.weights == "none"
    assert parse_args(["quality", "--split", "selection", "--shortlists", "8,20"]).shortlists == "8,20"
    assert parse_args(["step", "--rows", "1,58"]).rows == "1,58"
    for command in COMMANDS:
        add_arguments, run = handler(command)
        assert callable(add_arguments) and callable(run), command
    with pytest.raises(SystemExit):
        parse_args(["step", "--no-such-option"])


def test_quality_chooses_shortlist_sizes_only_off_the_validation_split():
    """A user comparing prompt sizes is stopped before any model loads: sizes are chosen where nothing is judged."""
    with pytest.raises(SystemExit, match="never validation"):
        handler("quality")[1](parse_args(["quality", "--shortlists", "8,20"]))


def test_serve_runs_the_engine_with_the_settings_asked_for_and_refuses_others():
    from bench.serve import engine_settings
    args = parse_args(["--engine", "forced_runs=0", "--engine", "max_seqs=8", "--engine", "fusion_weight=0.5"])
    assert engine_settings(args.engine) == {"forced_runs": False, "max_seqs": 8, "fusion_weight": 0.5}
    for bad in ("no_such=1", "forced_runs=yes", "max_seqs=eight", "fusion_weight_unseen=1"):
        with pytest.raises(SystemExit, match="--engine"):
            engine_settings([bad])


def test_a_burst_from_several_client_threads_gives_every_query_its_answer_alone(tmp_path, small_tokenizer_dir):
    """--clients: the all-at-once burst submitted by threads that each retrieve their own, as the server's do."""
    from bench.serve import answer_key
    from bench.workload import EngineDriver, Query
    from engine_fixtures import make_engine, metatool_trie, tiny_backend
    from shared.tokenizer import ModelTokenizer
    tok = ModelTokenizer(small_tokenizer_dir)
    driver = EngineDriver(make_engine(tiny_backend(tmp_path, tok.tokenizer.get_vocab_size(), 512), tok, 512))
    try:
        rt, _ = driver.warm(metatool_trie(tok, first=40), None)
        queries = [Query(intent, k) for intent, k in (("weather in paris", 2), ("a podcast please", 1),
                                                      ("stocks and news", 3), ("find a recipe", 2),
                                                      ("book a flight to rome", 1), ("convert a pdf", 2))]
        alone = driver.one_by_one(rt, queries)
        together, _, _ = driver.all_at_once(rt, queries, clients=4)
    finally:
        driver.close()
    assert [answer_key(r) for r in together] == [answer_key(r) for r in alone]
    assert [len(r["names"]) for r in together] == [q.k for q in queries]
    with pytest.raises(SystemExit, match="--clients"):
        handler("serve")[1](parse_args(["--clients", "0", "--no-peer"]))


def test_the_retrieval_table_times_the_intent_alone_and_its_parts_and_the_report_names_both(small_tokenizer_dir):
    """The shortlist encodes an intent's parts (the intent and its clauses); the table times that call too, since a
    request with several parts costs more than its intent alone, their token ids, and on a GPU the device scorer
    alone and its steps (tests/test_retrieval_cuda.py times them under the simulator)."""
    import numpy as np

    from bench.serve import retrieval_table
    from bench.workload import Query
    from decoder_service.retrieval.host import intent_parts
    from shared.tokenizer import ModelTokenizer

    class Recorder:
        backend_name, dim, digest = "cpu", 4, "recorder"

        def __init__(self):
            self.calls: list[list[str]] = []

        def token_ids(self, texts):
            return [np.arange(len(t.split()) + 2, dtype=np.int32) for t in texts]

        def encode(self, texts):
            self.calls.append(list(texts))
            v = np.random.default_rng(len(self.calls)).standard_normal((len(texts), self.dim)).astype(np.float32)
            return v / np.linalg.norm(v, axis=1, keepdims=True)

    intent = "convert the money first and then check the weather"
    enc = Recorder()
    out = retrieval_table(ModelTokenizer(small_tokenizer_dir), enc, [Query(intent, 2), Query("a podcast", 1)], 300, 12)
    assert len(intent_parts(intent)) == 3 and intent_parts(intent) in enc.calls and [intent] in enc.calls
    assert out["tools"] == 300 and all(out[k]["p50_ms"] > 0 for k in ("shortlist", "encode_intent", "encode_parts",
                                                                        "token_ids"))
    res = json.loads((RESULTS / "bench_h200.json").read_text())
    assert "device_score" not in out                                   # the host's scorer: nothing to time apart
    for later in ("token_ids", "device_steps_us"):                     # rows each added below, as runs gained them
        res["retrieval"].pop(later, None)
    res["retrieval"]["encode_parts"] = {**res["retrieval"]["encode_intent"], "p50_ms": 1.234}
    res["retrieval"]["device_score"] = {**res["retrieval"]["encode_intent"], "p50_ms": 0.312}
    assert ("(its parts, as the shortlist encodes them: 1.234 ms); the device scorer alone p50 0.312 ms."
            in report.markdown(res))
    res["retrieval"]["token_ids"] = {**res["retrieval"]["encode_intent"], "p50_ms": 0.035}
    assert "the device scorer alone p50 0.312 ms; the parts' token ids p50 0.035 ms." in report.markdown(res)
    res["retrieval"]["device_steps_us"] = {"encoder pass": 290.5, "k_fuse": 60.0}
    assert "| encoder pass | k_fuse | sum |\n| --- | --- | --- |\n| 290.5 | 60.0 | 350.5 |" in report.markdown(res)


def test_quality_table_names_each_ceiling_by_its_shortlist_size():
    """The ceiling row says which shortlist it is of: the one size measured (not the service's default), or each."""
    from bench.quality import sized, table
    one = {"set": "metatool", "queries": 3, "by_k": {"1": 3}, "shortlists": [8],
           "rows": {"shortlist": {"all": 0.9}, "tooltrie w=1": {"all": {"recall": 0.5, "exact": 0.5}}}}
    assert "gold in the shortlist (top 8) | all | 0.900" in table([one])
    sizes = (8, 20)
    several = {**one, "shortlists": list(sizes),
               "rows": {sized("shortlist", n, sizes): {"all": n / 100} for n in sizes}}
    text = table([several])
    assert "(top 8) | all | 0.080" in text and "(top 20) | all | 0.200" in text
    assert sized("tooltrie w=1", 12, (12,)) == "tooltrie w=1" and sized("fused", 8, sizes) == "fused N=8"


def test_bench_edits_no_import_path_and_imports_nothing_from_tests():
    test_modules = {p.stem for p in Path(__file__).parent.glob("*.py")} | {"tests"}
    for path in sorted((RESULTS.parent).glob("*.py")):
        text = path.read_text()
        assert "sys.path" not in text, path
        for node in ast.walk(ast.parse(text)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not [n for n in names if n.split(".")[0] in test_modules], (path, names)


def test_metatool_queries_are_the_first_279_single_and_all_190_double_in_file_order():
    lines = [json.loads(line) for line in (data_dir() / "metatool" / "dev_queries.jsonl").open()]
    queries = metatool_queries(lines)
    assert len(queries) == 469
    assert sum(q.k == 1 for q in queries) == 279 and sum(q.k == 2 for q in queries) == 190
    assert sum(len(q["tools"]) == 2 for q in lines) == 190
    positions = [next(i for i, line in enumerate(lines) if line["query"] == q.intent) for q in queries]
    assert positions == sorted(positions)
    last_single = max(p for p, q in zip(positions, queries) if q.k == 1)
    assert sum(len(line["tools"]) == 1 for line in lines[:last_single + 1]) == 279


def test_report_renders_the_recorded_h200_run_as_written():
    res = json.loads((RESULTS / "bench_h200.json").read_text())
    md = report.markdown(res)
    assert md + "\n" == (RESULTS / "bench_h200.md").read_text()
    assert "| smollm2-135m | metatool | 11.3x | 10.7x | 3.5x |" in md     # the shortlist prompt, both sides
    assert "| smollm2-135m | sealtools | 3.7x | 9.5x | 3.8x |" in md
    assert "100,000 tools: compiled in" in md and "**0 mismatches**" in md


def test_a_merged_run_keeps_the_workloads_it_does_not_measure_with_the_run_they_came_from():
    from bench.serve import kept_workloads
    earlier = {"started": "then", "args": {"workloads": "metatool,sealtools"},
               "workloads": {"metatool": {"tooltrie": 1}, "sealtools": {"tooltrie": 2}}}
    kept = kept_workloads(earlier, {"metatool": None})
    assert kept == {"sealtools": {"tooltrie": 2, "run": {"started": "then",
                                                          "args": {"workloads": "metatool,sealtools"}}}}
    again = kept_workloads({"started": "later", "args": {}, "workloads": kept}, {})
    assert again["sealtools"]["run"]["started"] == "then"        # a workload keeps its own run through merges
    assert kept_workloads(None, {}) == {}


def test_report_of_a_run_without_the_peer_has_no_peer_rows_and_no_ratios(tmp_path):
    res = json.loads((RESULTS / "bench_h200.json").read_text())
    for shape in res["shapes"].values():
        for w in shape["workloads"].values():
            w.pop("peer", None)
    md = report.write(res, tmp_path, "test")
    assert (tmp_path / "bench_test.json").exists() and (tmp_path / "bench_test.md").read_text() == md + "\n"
    assert "speed-up over the peer" not in md and "| peer |" not in md
    assert "| smollm2-135m | metatool | tooltrie |" in md


def test_sass_summary_counts_loops_before_the_last_exit_only():
    from bench.ptx import sass_summary
    body = [f"        /*{16 * i:04x}*/                   FFMA R1, R2, R3, R1 ;" for i in range(70)]
    listing = "\n".join([*body,
                         "        /*0460*/               @P0 BRA 0x0;",          # a 71-instruction loop
                         "        /*0470*/                   BRA 0x100 ;",       # 56: under 60, not listed
                         "        /*0480*/                   EXIT ;",
                         "        /*0490*/                   BRA 0x20 ;"])       # a divergent-warp fallback
    assert sass_summary(listing) == "74 instructions; loops: 71"

"""`python -m bench [command] [options]`: the benchmark harness. Without a command it runs `serve`
(`make bench`), so `python3 -m bench --shapes ... --workloads ...` is the headline run.

Correctness on the GPU is the suite's (`pytest -m gpu`: tests/test_gpu_*.py, tests/test_gemm.py); what is
here measures. Results are written under bench/results/ (bench/results/README.md).
"""
from __future__ import annotations

import argparse
import importlib
import sys

# command: (module, where it runs, what it measures)
COMMANDS = {
    "serve": ("serve", "any", "tooltrie against the PyTorch peer on MetaTool and Seal-Tools (the default)"),
    "quality": ("quality", "any", "recall@k and exact-set of the retrievers and of tooltrie's answers"),
    "calibration": ("calibration", "any", "each name's confidence fitted on the selection split, its calibration "
                    "on validation"),
    "feedback": ("feedback", "any", "MetaTool without examples, before and after learning from replayed feedback"),
    "step": ("forward", "GPU", "µs per layer of each kernel kind for R prefill or decode rows after a P-token "
             "prefix; attention variants"),
    "kernel-profile": ("forward", "GPU", "forward steps between cudaProfilerStart/Stop, for Nsight Compute"),
    "gemm": ("forward", "GPU", "k_gemm against the GEMV row tiles, µs per layer of each matrix"),
    "model": ("model", "GPU", "per-kernel µs and GB/s at batch 1 (cold L2), whole decode steps, long context"),
    "constrained-step": ("sampler", "any", "constrained (sparse head + trie sampler) vs unconstrained decode step"),
    "sampler": ("sampler", "GPU", "the sampler kernels, constant-memory vs global-memory trie"),
    "engine-phases": ("host", "any", "a concurrency-1 query's steps by engine phase"),
    "host-step": ("host", "any", "the engine's host time between two steps at R decoding rows"),
    "swap": ("host", "any", "the first request after a catalog switch against the steady state"),
    "compiler": ("compiler", "any", "compile and publish MetaTool, Seal-Tools, StableToolBench and 100,000 generated "
                 "tools: times, blob sizes, peak memory"),
    "encoder": ("encoder", "any", "the sentence encoder against float64, then one query, parts, batches, clients, a "
                "catalog, and requests beside it"),
    "admission": ("admission", "any", "a burst of requests: answered in time, refused early or expired, per "
                  "TOOLTRIE_MAX_SEQS, with and without the deadline check"),
    "new-version": ("version", "any", "a new catalog version's first answer, end to end: redis-server, the compiler "
                    "and the decoder as processes"),
    "chaos": ("chaos", "any", "issue 53's chaos run: hot swaps, duplicate ids, forged events, Redis restarts and "
              "SIGTERM under load, outcomes by cause"),
    "slow-catalog": ("chaos", "any", "a small catalog's first answer while a 100,000-tool one loads"),
    "reader": ("reader", "any", "the reader's time a request on unseen catalogs' shortlists, its bits against the "
               "CPU backend's"),
    "ptx": ("ptx", "no GPU", "registers, spills and SASS of kernels for sm_90; PTX against another checkout"),
}


def handler(command: str):
    """(add_arguments, run) of a command: functions `<name>_arguments` and `<name>` of its module."""
    module = importlib.import_module(f"bench.{COMMANDS[command][0]}")
    name = command.replace("-", "_")
    return getattr(module, f"{name}_arguments"), getattr(module, name)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line's namespace; `command` names the command (serve where none is given)."""
    argv = list(argv)
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
        argv.insert(0, "serve")
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="command", required=True)
    for command, (module, where, what) in COMMANDS.items():
        p = sub.add_parser(command, help=f"[{where}] {what}", formatter_class=argparse.RawDescriptionHelpFormatter)
        if command == argv[0]:       # only the chosen command's module is imported
            add_arguments, _ = handler(command)
            p.description = importlib.import_module(f"bench.{module}").__doc__
            add_arguments(p)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    handler(args.command)[1](args)


if __name__ == "__main__":
    main()

"""`python -m bench new-version`: a new catalog version's first answer, end to end, with real processes.

redis-server, the compiler and the decoder start as `make run` starts them (the decoder with this machine's
settings: its model, encoder and backend); a first catalog is published and answered (so that the kernels, the
models and the engine are warm), then new versions of a second catalog are published one after another, each
differing from the last in one tool's description. Each is timed from the Publish call: until Publish returns (the
compiler), until the decoder's GetInfo lists it as the catalog's ready default (its tool vectors and prefix), and
until its first answer has streamed back. Issue 27's target for a 4,076-tool version (Seal-Tools, the default): 2 s
on the H200, 2 minutes on 2 CPU cores.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import grpc

from bench.common import RESULTS, device_label, log
from devstack.redis_server import LocalRedis, free_port
from devstack.stack import start_service, stop, wait_serving
from shared.config import Settings
from shared.dataset import catalog_path, data_dir
from shared.rpc import compiler_pb2 as cpb, compiler_pb2_grpc as cpb_grpc
from tooltrie.client import DecoderClient, open_channel

CATALOG = "bench"     # the catalog name every version is published under


def new_version_arguments(p) -> None:
    p.add_argument("--first", default="metatool", help="data set whose catalog is published and answered first")
    p.add_argument("--catalog", default="bigcatalog", help="data set whose catalog the new versions are")
    p.add_argument("--versions", type=int, default=2, help="new versions, each timed")
    p.add_argument("--intent", default="Find me a flight from Boston to Denver next Monday")
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600, help="seconds a version may take to its first answer")
    p.add_argument("--out", default=str(RESULTS))


def revision(tools: list[dict], i: int) -> list[dict]:
    """The catalog with its first tool's description ending in revision i: a new version, every other tool kept."""
    first = dict(tools[0], description=f"{tools[0].get('description', '')} Revision {i}.".strip())
    return [first, *tools[1:]]


def first_answer(publish, decoder: DecoderClient, tools: list[dict], intent: str, k: int, timeout: float) -> dict:
    """Publish the tools as a new version and time it: Publish's return, the decoder ready on it, its first
    answer (the stream's end)."""
    started = time.monotonic()
    request = cpb.PublishRequest(name=CATALOG, registry_json=json.dumps(tools))
    version = publish(request, timeout=timeout).version.version
    published = time.monotonic()
    while time.monotonic() - started < timeout:
        if any(c.name == CATALOG and c.version == version and c.latest and c.ready for c in decoder.info().catalogs):
            ready = time.monotonic()
            names = [tool.name for tool in decoder.discover(CATALOG, intent, k, version=version)]
            return {"version": version, "tools": len(tools), "publish_s": round(published - started, 3),
                    "ready_s": round(ready - started, 3), "first_answer_s": round(time.monotonic() - started, 3),
                    "names": names}
        time.sleep(0.05)
    raise SystemExit(f"version {version} gave no answer within {timeout:.0f} s")


def new_version(args) -> None:
    settings, started = Settings(), time.strftime("%Y-%m-%d %H:%M:%S")
    for name in (args.first, args.catalog):
        if not catalog_path(name).is_file():
            data = data_dir()
            sets = sorted(d.name for d in data.iterdir() if (d / "catalog.json").is_file())
            raise SystemExit(f"no data set {name!r} under {data}: one of {', '.join(sets)}")
    first, tools = (json.loads(catalog_path(name).read_text()) for name in (args.first, args.catalog))
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        redis = stack.enter_context(LocalRedis(Path(tmp) / "redis"))
        compiler_addr, decoder_addr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        env = {**os.environ, "REDIS_URL": redis.url, "TOOLTRIE_COMPILER_ADDR": compiler_addr,
               "TOOLTRIE_DECODER_ADDR": decoder_addr, "TOOLTRIE_METRICS_PORT": "0", "TOOLTRIE_NAMESPACE": "bench"}
        compiler = start_service("compiler_service.server", env, Path(tmp) / "compiler.log")
        stack.callback(stop, compiler)
        decoder = start_service("decoder_service.server", env, Path(tmp) / "decoder.log")
        stack.callback(stop, decoder)
        wait_serving(compiler_addr, 120, compiler)
        publish = cpb_grpc.CompilerServiceStub(open_channel(compiler_addr, settings)).Publish
        client = stack.enter_context(DecoderClient(decoder_addr, timeout=args.timeout, settings=settings))
        grpc.channel_ready_future(client.channel).result(timeout=120)     # listening; SERVING once a catalog is
        runs = [first_answer(publish, client, first, args.intent, args.k, args.timeout)]
        log(f"{args.first}: {json.dumps(runs[0])}")
        backend = client.info().backend
        for i in range(args.versions):
            runs.append(first_answer(publish, client, revision(tools, i), args.intent, args.k, args.timeout))
            log(f"{args.catalog}, revision {i}: {json.dumps(runs[-1])}")
    out = Path(args.out) / f"new_version_{device_label(backend)}.json"
    out.write_text(json.dumps({"backend": backend, "started": started,
                               "args": {k: v for k, v in vars(args).items() if k != "command"}, "runs": runs},
                              indent=1) + "\n")
    log("| version | tools | Publish returned s | ready s | first answer s |\n| --- | --- | --- | --- | --- |")
    for r in runs:
        log(f"| {r['version']} | {r['tools']:,} | {r['publish_s']:.2f} | {r['ready_s']:.2f} "
            f"| {r['first_answer_s']:.2f} |")
    log(f"written to {out}")

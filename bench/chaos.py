"""`python -m bench chaos` and `python -m bench slow-catalog`: issue 53's chaos run and slow catalog, end to end."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import grpc
import redis

from bench.common import RESULTS, device_label, log
from devstack.redis_server import LocalRedis, free_port
from devstack.stack import start_service, stop, wait_serving
from shared.catalog import clip
from shared.config import DEFAULT_ENCODER_DIR, DEFAULT_MODEL_DIR
from shared.dataset import catalog_path
from shared.rpc import compiler_pb2 as cpb, compiler_pb2_grpc as cpb_grpc
from shared.rpc import decoder_pb2 as pb, decoder_pb2_grpc as pb_grpc
from shared.store import CatalogStore
from tooltrie.client import open_channel

NAMESPACE = "chaos"
MODES = (pb.MODE_AUTO, pb.MODE_DECODE, pb.MODE_RETRIEVE)
HANG_SLACK = 5.0          # a decoder not gone drain + this many seconds after SIGTERM is hung
RECONNECT = 10.0          # seconds after Redis is back during which "redis is unavailable" is still its outage
Code = grpc.StatusCode
CORRECT, WRONG, INTERNAL = "answered correctly", "wrong answer", "INTERNAL"
EXPECTED = {"duplicate": "refused: ALREADY_EXISTS (a duplicate id)", "busy": "refused: RESOURCE_EXHAUSTED",
            "redis": "refused: UNAVAILABLE (Redis down)", "loading": "refused: UNAVAILABLE (a catalog loading)",
            "stopping": "refused: UNAVAILABLE (the decoder stopping)"}


def forged_events(catalog: str) -> list[str]:
    """What a writer to the events channel might send: every one must be dropped (counted, one clipped log line)
    while the catalogs are served on, a version never published and a deletion of a catalog still there included."""
    return ['{"name": 5}', "not json", json.dumps({"name": "n" * 200_000, "version": 1}),
            json.dumps({"name": catalog, "version": -3}), '[1, 2]', json.dumps({"name": "bad name!", "version": 1}),
            json.dumps({"name": catalog, "version": "2"}), json.dumps({"name": catalog, "version": 2**31 - 1}),
            json.dumps({"name": catalog, "event": "delete"}),
            b"\xff\xfe" + os.urandom(64)]


def chaos_arguments(p) -> None:
    p.add_argument("--seconds", type=float, default=180, help="how long the clients, swaps, forgeries and restarts run")
    p.add_argument("--clients", type=int, default=8, help="concurrent Discover streams")
    p.add_argument("--catalogs", type=int, default=3, help="catalogs, each a subset of the data set's tools")
    p.add_argument("--dataset", default="metatool", help="the data set whose tools the catalogs are")
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="the decoder's model directory")
    p.add_argument("--encoder", default="", help="the decoder's encoder directory (empty: BM25 alone)")
    p.add_argument("--drain", type=float, default=2.0, help="TOOLTRIE_DRAIN_SECONDS of every decoder")
    p.add_argument("--duplicates", type=float, default=0.15, help="share of calls that reuse a live call's id")
    p.add_argument("--redis-restarts", type=int, default=0, help="Redis restarts (0: one, two past 60 s)")
    p.add_argument("--redis-down", type=float, default=3.0, help="seconds Redis stays down at each restart")
    p.add_argument("--sigterm-tries", type=int, default=20, help="decoders started, loaded and sent SIGTERM")
    p.add_argument("--sigterm-load", type=int, default=24, help="MODE_DECODE calls in flight at each SIGTERM")
    p.add_argument("--timeout", type=float, default=30, help="each Discover call's deadline, in seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS))


def services_env(redis_url: str, model: str, encoder: str, **extra: str) -> dict:
    return {**os.environ, "REDIS_URL": redis_url, "TOOLTRIE_NAMESPACE": NAMESPACE, "TOOLTRIE_METRICS_PORT": "0",
            "TOOLTRIE_MODEL_DIR": model, "TOOLTRIE_ENCODER_DIR": encoder, **extra}


def start_compiler(stack: ExitStack, env: dict, tmp: Path):
    """The compiler on a free port, stopped with the stack; its stub."""
    addr = f"127.0.0.1:{free_port()}"
    proc = start_service("compiler_service.server", {**env, "TOOLTRIE_COMPILER_ADDR": addr}, tmp / "compiler.log")
    stack.callback(stop, proc)
    wait_serving(addr, 120, proc)
    return cpb_grpc.CompilerServiceStub(open_channel(addr))


class Chaos:
    """One run's processes and what its threads saw: outcomes by (phase, cause), the answers to check at the end,
    the tool names of every version published, and the count of each disturbance."""

    def __init__(self, args, redis_server: LocalRedis, compiler, env: dict, tmp: Path):
        self.args, self.redis, self.compiler, self.env, self.tmp = args, redis_server, compiler, env, tmp
        self.tools = json.loads(catalog_path(args.dataset).read_text())
        self.intents = [t["description"][:200] for t in self.tools if t.get("description")]
        self.catalogs = [f"chaos-{chr(ord('a') + i)}" for i in range(args.catalogs)]
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.outcomes: Counter = Counter()         # (phase, cause) -> calls
        self.examples: dict[str, str] = {}         # cause -> its first message
        self.answers: list[tuple] = []             # (phase, catalog, k, events)
        self.names: dict[tuple[str, int], set[str]] = {}
        self.events: Counter = Counter()           # disturbances and what became of them
        self.live: dict[str, int] = {}             # request id -> client, for calls accepted and still streaming
        self.redis_down: list[list] = []           # [stopped at, started again at (None while down)]

    def add(self, phase: str, cause: str, example: str = "") -> None:
        with self.lock:
            self.outcomes[phase, cause] += 1
            if example and cause != CORRECT:
                self.examples.setdefault(cause, clip(example, 300))

    def count(self, what: str) -> None:
        with self.lock:
            self.events[what] += 1

    # --- the catalogs' versions ----------------------------------------------------------------------------
    def publish(self, name: str, rng: random.Random) -> None:
        """A random subset of the tools as a new version; its names kept (from the compiler) to check answers."""
        tools = rng.sample(self.tools, rng.randint(len(self.tools) // 2, len(self.tools)))
        reply = self.compiler.Publish(cpb.PublishRequest(name=name, registry_json=json.dumps(tools)), timeout=120)
        self.count("versions published" if reply.created else "publishes unchanged")
        self.version_names(name, reply.version.version)

    def version_names(self, name: str, version: int, patience: float = 30) -> set[str] | None:
        """A version's tool names from GetCatalog, retried while Redis is down; None when they cannot be had."""
        if (name, version) in self.names:
            return self.names[name, version]
        deadline = time.monotonic() + patience
        while True:
            try:
                reply = self.compiler.GetCatalog(cpb.GetCatalogRequest(name=name, version=version), timeout=10)
                self.names[name, version] = set(reply.tool_names)
                return self.names[name, version]
            except grpc.RpcError as e:
                if e.code() != Code.UNAVAILABLE or time.monotonic() > deadline:
                    return None
                time.sleep(0.2)

    def hot_swaps(self) -> None:
        rng = random.Random(self.args.seed + 1)
        while not self.stop.wait(rng.uniform(1, 2)):
            name = rng.choice(self.catalogs)
            older = sorted(v for n, v in self.names if n == name)[-6:-1]   # recent ones, so probably still kept
            try:
                if older and rng.random() < 0.2:
                    self.compiler.SetLatest(cpb.SetLatestRequest(name=name, version=rng.choice(older)), timeout=30)
                    self.count("rollbacks")
                else:
                    self.publish(name, rng)
            except grpc.RpcError as e:
                self.count(f"compiler calls refused: {e.code().name}")

    # --- disturbances --------------------------------------------------------------------------------------
    def forge(self) -> None:
        rng = random.Random(self.args.seed + 2)
        store = CatalogStore.from_url(self.redis.url, namespace=NAMESPACE)
        forged = forged_events(self.catalogs[0])
        while not self.stop.wait(rng.uniform(1.5, 3)):
            try:
                store.r.publish(store.channel, rng.choice(forged))
                self.count("forged events sent")
            except (redis.ConnectionError, redis.TimeoutError):
                self.count("forged events not sent (Redis down)")

    def restart_redis(self, at: list[float]) -> None:
        """Stop Redis at each of the times `at` (seconds into the run) for --redis-down seconds (its append-only
        file keeps the data)."""
        started = time.monotonic()
        for t in at:
            if self.stop.wait(max(t - (time.monotonic() - started), 0)):
                return
            window = [time.monotonic(), None]
            self.redis_down.append(window)
            self.redis.stop()
            time.sleep(self.args.redis_down)
            self.redis.start()
            window[1] = time.monotonic()
            self.count("Redis restarts")

    def redis_was_down(self, started: float, ended: float) -> bool:
        return any(down <= ended and (up is None or up + RECONNECT >= started) for down, up in self.redis_down)

    # --- calls ---------------------------------------------------------------------------------------------
    def call(self, stub, request, phase: str, duplicate: bool = False, on_first=None) -> bool:
        """One Discover: its answer kept to be checked (True), or its refusal tallied by cause (False)."""
        started, events = time.monotonic(), []
        try:
            for event in stub.Discover(request, timeout=self.args.timeout):
                if not events and on_first:
                    on_first()
                events.append(event)
        except grpc.RpcError as e:
            self.add(phase, self.refusal(e, phase, duplicate, started), f"{e.code().name}: {e.details()}")
            return False
        with self.lock:
            self.answers.append((phase, request.catalog, request.k, events))
        return True

    def refusal(self, e: grpc.RpcError, phase: str, duplicate: bool, started: float) -> str:
        code, details = e.code(), e.details() or ""
        if code == Code.ALREADY_EXISTS and duplicate:
            return EXPECTED["duplicate"]
        if code == Code.RESOURCE_EXHAUSTED:
            return EXPECTED["busy"]
        if code == Code.UNAVAILABLE:
            if phase == "SIGTERM":
                return EXPECTED["stopping"]
            if "is loading" in details or "still reading the store" in details:
                return EXPECTED["loading"]
            if "redis is unavailable" in details and self.redis_was_down(started, time.monotonic()):
                return EXPECTED["redis"]
        return INTERNAL if code == Code.INTERNAL else f"unexpected: {code.name}"

    def client(self, stub, i: int) -> None:
        rng, n = random.Random(self.args.seed * 1000 + i), 0
        while not self.stop.is_set():
            n += 1
            with self.lock:
                others = [rid for rid, owner in self.live.items() if owner != i]
            duplicate = bool(others) and rng.random() < self.args.duplicates
            request_id = rng.choice(others) if duplicate else f"client{i}-{n}"
            if duplicate:
                self.count("duplicate ids sent")

            def accepted(rid=request_id):
                with self.lock:
                    self.live[rid] = i
            request = pb.DiscoverRequest(catalog=rng.choice(self.catalogs), intent=rng.choice(self.intents),
                                         k=rng.randint(1, 3), mode=rng.choice(MODES), request_id=request_id)
            answered = self.call(stub, request, "chaos", duplicate, None if duplicate else accepted)
            if not duplicate:
                with self.lock:
                    self.live.pop(request_id, None)
            if not answered:     # backing off as a client would (busy, loading), not spinning on refusals
                time.sleep(rng.uniform(0.1, 0.5))

    def wrong(self, catalog: str, k: int, events) -> str:
        """Why an answer is wrong ("" when it is right): k distinct names of the version its Accepted names."""
        if not events or not events[0].HasField("accepted") or not events[-1].HasField("done"):
            return f"not Accepted ... Done: {[e.WhichOneof('event') for e in events]}"
        accepted = events[0].accepted
        names = [e.pointer.name for e in events[1:-1]]
        if accepted.catalog != catalog:
            return f"asked {catalog}, answered from {accepted.catalog}"
        known = self.version_names(catalog, accepted.version, patience=0)
        if known is None:
            return f"{catalog} v{accepted.version}: a version whose names the compiler does not know"
        if len(names) != k or len(set(names)) != k or not set(names) <= known:
            return f"{catalog} v{accepted.version} k={k}: {names}"
        return ""

    # --- SIGTERM under load --------------------------------------------------------------------------------
    def sigterm_try(self, i: int, catalog: str) -> dict:
        """A fresh decoder serving `catalog`, loaded with MODE_DECODE calls of large k, sent SIGTERM and timed."""
        addr, drain = f"127.0.0.1:{free_port()}", self.args.drain
        env = {**self.env, "TOOLTRIE_DECODER_ADDR": addr, "TOOLTRIE_CATALOGS": catalog}
        proc = start_service("decoder_service.server", env, self.tmp / f"sigterm_{i}.log")
        try:
            wait_serving(addr, 600, proc, service=f"tooltrie.catalog.{catalog}")
            stub = pb_grpc.DecoderServiceStub(open_channel(addr))
            firsts = [threading.Event() for _ in range(self.args.sigterm_load)]
            calls = [threading.Thread(target=self.call, args=(stub, pb.DiscoverRequest(
                catalog=catalog, intent=self.intents[(i * 31 + j) % len(self.intents)], k=30, shortlist=40,
                mode=pb.MODE_DECODE, request_id=f"sigterm{i}-{j}"), "SIGTERM"), kwargs={"on_first": first.set})
                for j, first in enumerate(firsts)]
            for t in calls:
                t.start()
            deadline = time.monotonic() + 60     # until every call streams (or was refused, or ended)
            while time.monotonic() < deadline and any(t.is_alive() and not f.is_set() for f, t in zip(firsts, calls)):
                time.sleep(0.05)
            streaming = sum(f.is_set() and t.is_alive() for f, t in zip(firsts, calls))
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            try:
                rc, exit_s = proc.wait(drain + HANG_SLACK), round(time.monotonic() - signalled, 2)
            except subprocess.TimeoutExpired:
                rc, exit_s = None, None
            for t in calls:
                t.join(self.args.timeout)
            hung = {"log_tail": (self.tmp / f"sigterm_{i}.log").read_text()[-3000:]} if rc is None else {}
            return {"try": i, "streaming_at_sigterm": streaming, "exit_s": exit_s, "rc": rc, "hung": rc is None, **hung}
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    # --- the run -------------------------------------------------------------------------------------------
    def run(self, stack: ExitStack) -> tuple[str, list[dict]]:
        """The chaos phase then the SIGTERM tries; the decoder's backend and the tries' records."""
        rng = random.Random(self.args.seed)
        for name in self.catalogs:
            self.publish(name, rng)
        addr = f"127.0.0.1:{free_port()}"
        decoder = start_service("decoder_service.server", {**self.env, "TOOLTRIE_DECODER_ADDR": addr},
                                self.tmp / "decoder.log")
        stack.callback(stop, decoder)
        for name in self.catalogs:
            wait_serving(addr, 900, decoder, service=f"tooltrie.catalog.{name}")
        stub = pb_grpc.DecoderServiceStub(open_channel(addr))
        backend = stub.GetInfo(pb.GetInfoRequest(), timeout=30).backend
        restarts = self.args.redis_restarts or (2 if self.args.seconds > 60 else 1)
        at = [self.args.seconds * (j + 1) / (restarts + 1) for j in range(restarts)]
        threads = [threading.Thread(target=self.client, args=(stub, i)) for i in range(self.args.clients)]
        threads += [threading.Thread(target=self.hot_swaps), threading.Thread(target=self.forge),
                    threading.Thread(target=self.restart_redis, args=(at,))]
        log(f"chaos: {self.args.clients} clients on {', '.join(self.catalogs)} for {self.args.seconds:.0f} s "
            f"({backend}); Redis restarts at {', '.join(f'{t:.0f}' for t in at)} s")
        for t in threads:
            t.start()
        time.sleep(self.args.seconds)
        self.stop.set()
        for t in threads:
            t.join()
        if decoder.poll() is not None:
            self.count(f"the decoder exited during the run (rc {decoder.returncode})")
        stop(decoder)
        tries = []
        for i in range(self.args.sigterm_tries):
            tries.append(self.sigterm_try(i, self.catalogs[i % len(self.catalogs)]))
            log(f"SIGTERM try {i + 1}: {json.dumps({k: v for k, v in tries[-1].items() if k != 'log_tail'})}")
        for phase, catalog, k, events in self.answers:
            why = self.wrong(catalog, k, events)
            self.add(phase, WRONG if why else CORRECT, why)
        return backend, tries


def chaos(args) -> None:
    """redis-server, the compiler and a decoder as processes under clients, hot swaps, forged events and Redis
    restarts for --seconds, then SIGTERM under load --sigterm-tries times: outcomes by cause; non-zero exit on a
    wrong answer, INTERNAL, or a decoder not gone drain + 5 s after SIGTERM (the issue's "done when")."""
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        tmp = Path(tmp)
        redis_server = stack.enter_context(LocalRedis(tmp / "redis"))
        env = services_env(redis_server.url, args.model, args.encoder, TOOLTRIE_DRAIN_SECONDS=str(args.drain))
        run = Chaos(args, redis_server, start_compiler(stack, env, tmp), env, tmp)
        backend, tries = run.run(stack)
    hung = sum(t["hung"] for t in tries)
    exits = [t["exit_s"] for t in tries if t["exit_s"] is not None]
    failures = {cause: n for (_, cause), n in run.outcomes.items() if cause in (WRONG, INTERNAL)}
    failures.update({"hung processes": hung} if hung else {})
    failures.update({what: n for what, n in run.events.items() if what.startswith("the decoder exited")})
    out = Path(args.out) / f"chaos_{device_label(backend)}.json"
    out.write_text(json.dumps({
        "backend": backend, "started": started, "args": {k: v for k, v in vars(args).items() if k != "command"},
        "outcomes": {phase: {cause: n for (p, cause), n in sorted(run.outcomes.items()) if p == phase}
                     for phase in ("chaos", "SIGTERM")},
        "examples": run.examples, "events": dict(sorted(run.events.items())),
        "versions_answered": sorted({f"{a[1]} v{a[3][0].accepted.version}" for a in run.answers if a[3]}),
        "sigterm": {"tries": tries, "hung": hung, "max_exit_s": max(exits, default=None),
                    "exit_limit_s": args.drain + HANG_SLACK},
        "failures": failures}, indent=1) + "\n")
    served = len({(a[1], a[3][0].accepted.version) for a in run.answers if a[0] == "chaos" and a[3]})
    log(f"\n{', '.join(f'{n} {what}' for what, n in sorted(run.events.items()))}; "
        f"{served} versions answered ({served - len(run.catalogs)} hot swaps served)")
    for cause, example in sorted(run.examples.items()):
        log(f"  e.g. {cause}: {example}")
    log("\n| outcome | chaos calls | SIGTERM-phase calls |\n| --- | --- | --- |")
    causes = [CORRECT, *EXPECTED.values(), WRONG, INTERNAL]
    causes += sorted({c for _, c in run.outcomes} - set(causes))
    for cause in causes:
        log(f"| {cause} | {run.outcomes['chaos', cause]} | {run.outcomes['SIGTERM', cause]} |")
    log(f"\n| SIGTERM tries | hung (not gone in {args.drain + HANG_SLACK:.1f} s) | max exit s | watchdog exits (rc 1) |"
        f"\n| --- | --- | --- | --- |\n| {len(tries)} | {hung} | {max(exits, default=0):.2f} | "
        f"{sum(t['rc'] == 1 for t in tries)} |")
    log(f"written to {out}")
    if failures:
        raise SystemExit(f"chaos: {json.dumps(failures)}")


def slow_catalog_arguments(p) -> None:
    p.add_argument("--tools", type=int, default=100_000, help="the huge catalog's synthetic tools (0: no huge "
                   "catalog, the baseline)")
    p.add_argument("--small-tools", type=int, default=20, help="the small catalog: the data set's first tools")
    p.add_argument("--dataset", default="metatool")
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="the decoder's model directory")
    p.add_argument("--encoder", default=str(DEFAULT_ENCODER_DIR), help="the decoder's encoder directory")
    p.add_argument("--within", type=float, default=5.0, help="seconds from the decoder's spawn (its start) to the "
                   "small catalog's first answer (more fails the run)")
    p.add_argument("--watch", type=float, default=600.0, help="seconds the huge catalog is watched after the small "
                   "one's answer, until it twice says how far its vectors are")
    p.add_argument("--timeout", type=float, default=300, help="seconds the small catalog may take")
    p.add_argument("--out", default=str(RESULTS))


VECTORS_LOADING = "texts' vectors); retry shortly"     # how a catalog computing its vectors answers


def synthetic_tools(n: int) -> list[dict]:
    verbs, things = ("list", "create", "update", "delete", "search"), ("invoices", "tickets", "repos", "orders")
    return [{"name": f"tool_{i:05d}", "description": f"{verbs[i % 5]} {things[i // 5 % 4]} in workspace {i}"}
            for i in range(n)]


def slow_catalog(args) -> None:
    """A small catalog's first answer while a huge one computes its vectors (issue 53: within 5 s of the decoder's
    start), timed from the spawn and from the "listening" line; non-zero exit past --within from the spawn."""
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    small = json.loads(catalog_path(args.dataset).read_text())[:args.small_tools]
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        tmp = Path(tmp)
        redis_server = stack.enter_context(LocalRedis(tmp / "redis"))
        env = services_env(redis_server.url, args.model, args.encoder)
        compiler = start_compiler(stack, env, tmp)
        publish_s = {}
        for name, tools in [("small", small), *([("huge", synthetic_tools(args.tools))] if args.tools else [])]:
            t = time.monotonic()
            compiler.Publish(cpb.PublishRequest(name=name, registry_json=json.dumps(tools)), timeout=1800)
            publish_s[name] = round(time.monotonic() - t, 2)
            log(f"published {name}: {len(tools):,} tools in {publish_s[name]:.1f} s")
        addr, decoder_log = f"127.0.0.1:{free_port()}", tmp / "decoder.log"
        spawned = time.monotonic()
        decoder = start_service("decoder_service.server", {**env, "TOOLTRIE_DECODER_ADDR": addr}, decoder_log)
        stack.callback(stop, decoder)
        while "decoder listening" not in decoder_log.read_text():
            if decoder.poll() is not None or time.monotonic() - spawned > args.timeout:
                raise SystemExit(f"the decoder did not listen: {decoder_log.read_text()[-2000:]}")
            time.sleep(0.05)
        listening = time.monotonic()
        stub = pb_grpc.DecoderServiceStub(open_channel(addr))
        refusals: Counter = Counter()
        while True:
            try:
                answer = [e.pointer.name for e in stub.Discover(pb.DiscoverRequest(
                    catalog="small", intent=small[0]["description"], k=2), timeout=10) if e.HasField("pointer")]
                answered = time.monotonic()
                break
            except grpc.RpcError as e:
                refusals[f"{e.code().name}: {clip(e.details() or '', 120)}"] += 1
            if decoder.poll() is not None or time.monotonic() - spawned > args.timeout:
                raise SystemExit(f"small gave no answer: {dict(refusals)}")
            time.sleep(0.05)
        huge, vectors_seen = [], 0      # what the huge catalog answers, until it twice says how far its vectors are
        while args.tools and vectors_seen < 2 and time.monotonic() - answered < args.watch:
            try:
                list(stub.Discover(pb.DiscoverRequest(catalog="huge", intent="update tickets", k=2), timeout=10))
                huge.append((round(time.monotonic() - spawned, 1), "answered"))
            except grpc.RpcError as e:
                huge.append((round(time.monotonic() - spawned, 1), f"{e.code().name}: {e.details()}"))
            vectors_seen += VECTORS_LOADING in huge[-1][1]
            time.sleep(5)
        backend = stub.GetInfo(pb.GetInfoRequest(), timeout=30).backend
        loads = [clip(line, 300) for line in decoder_log.read_text().splitlines()
                 if "tooltrie.catalogs" in line or "listening" in line][:60]
    record = {"backend": backend, "started": started, "args": {k: v for k, v in vars(args).items() if k != "command"},
              "publish_s": publish_s, "listening_s": round(listening - spawned, 2),
              "small_first_answer_s": round(answered - spawned, 2),
              "small_first_answer_after_listening_s": round(answered - listening, 2), "small_answer": answer,
              "small_refusals_before": dict(refusals), "huge_meanwhile": huge,
              "decoder_log": loads}
    out = Path(args.out) / f"slow_catalog_{device_label(backend)}{'' if args.tools else '_baseline'}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    log(f"\n| | s from spawn | s from \"listening\" |\n| --- | --- | --- |\n"
        f"| decoder listening | {record['listening_s']:.2f} | 0 |\n"
        f"| small ({len(small)} tools): first answer {answer} | {record['small_first_answer_s']:.2f} | "
        f"{record['small_first_answer_after_listening_s']:.2f} |")
    for at, what in huge:
        log(f"| huge ({args.tools:,} tools) | {at:.1f} | {at - record['listening_s']:.1f}: {what} |")
    log(f"before its answer, small was refused: {dict(refusals)}\nwritten to {out}")
    loading = not args.tools or any(VECTORS_LOADING in what for _, what in huge)
    if answered - spawned > args.within or not loading:
        raise SystemExit(f"slow-catalog: the small catalog answered {answered - spawned:.1f} s after the decoder's "
                         f"spawn (limit {args.within:.0f} s); the huge one loading: {loading}")

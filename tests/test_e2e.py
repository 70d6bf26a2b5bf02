"""End to end with real processes: redis-server, the compiler and the decoder (CPU backend).

The decoder serves a tiny random model that speaks the small test tokenizer, so the whole stack runs
in seconds; the real model's behaviour is covered by the model and engine tests.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from devstack.redis_server import LocalRedis, free_port
from model_fixtures import make_serving_model
from shared.rpc import compiler_pb2 as cpb, compiler_pb2_grpc as cpb_grpc
from shared.rpc import decoder_pb2 as pb, decoder_pb2_grpc as pb_grpc
from tokenizer_fixtures import catalog_path

TOOLS = json.loads(catalog_path("metatool").read_text())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, small_tokenizer_dir):
    return make_serving_model(tmp_path_factory.mktemp("model"), small_tokenizer_dir)


class Stack:
    """redis-server (or, given redis_url, a namespace of that Redis), compiler and decoder as child processes
    on loopback ports."""

    def __init__(self, tmp_path, model_dir, redis_url=None, namespace="e2e"):
        self.redis = LocalRedis(tmp_path / "redis", appendonly=True).start() if redis_url is None else None
        self.compiler_addr, self.decoder_addr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        self.metrics_port = free_port()
        self.env = {**os.environ, "REDIS_URL": redis_url or self.redis.url, "TOOLTRIE_MODEL_DIR": str(model_dir),
                    "TOOLTRIE_READER_DIR": str(model_dir),
                    "TOOLTRIE_COMPILER_ADDR": self.compiler_addr, "TOOLTRIE_DECODER_ADDR": self.decoder_addr,
                    "TOOLTRIE_BACKEND": "cpu", "TOOLTRIE_KV_TOKENS": "65536", "TOOLTRIE_DRAIN_SECONDS": "20",
                    "TOOLTRIE_METRICS_PORT": "0", "TOOLTRIE_NAMESPACE": namespace}
        self.logs = tmp_path
        self.compiler = self._start("compiler_service.server", {})
        self.decoder = self._start("decoder_service.server", {"TOOLTRIE_METRICS_PORT": str(self.metrics_port)})
        self.compiler_stub = cpb_grpc.CompilerServiceStub(grpc.insecure_channel(self.compiler_addr))
        self.decoder_channel = grpc.insecure_channel(self.decoder_addr)
        self.decoder_stub = pb_grpc.DecoderServiceStub(self.decoder_channel)
        wait_health(self.compiler_addr, self.compiler)

    def _start(self, module, extra):
        log = open(self.logs / f"{module}.log", "w")
        return subprocess.Popen([sys.executable, "-m", module], env={**self.env, **extra}, stdout=log,
                                stderr=subprocess.STDOUT)

    def publish(self, tools, name="demo"):
        return self.compiler_stub.Publish(cpb.PublishRequest(name=name, registry_json=json.dumps(tools)),
                                          timeout=60).version.version

    def discover(self, intent, k, timeout=60, **kw):
        events = list(self.decoder_stub.Discover(pb.DiscoverRequest(catalog="demo", intent=intent, k=k, **kw),
                                                 timeout=timeout))
        assert events[0].HasField("accepted") and events[-1].HasField("done")
        return events[0].accepted.version, [e.pointer.name for e in events[1:-1]]

    def stop(self):
        for proc in (self.decoder, self.compiler):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if self.redis is not None:
            self.redis.stop()


def health_status(addr):
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(addr))
    try:
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
    except grpc.RpcError:
        return None


def wait_health(addr, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while health_status(addr) != health_pb2.HealthCheckResponse.SERVING:
        assert proc.poll() is None, f"{addr} exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"{addr} not healthy after {timeout} s"
        time.sleep(0.1)


def wait_until(predicate, timeout=60, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model_dir):
    s = Stack(tmp_path_factory.mktemp("stack"), model_dir)
    yield s
    s.stop()


def test_health_serves_only_once_a_catalog_is_warm(stack):
    time.sleep(1.0)  # the model is loaded by now; no catalog is published yet
    assert health_status(stack.decoder_addr) != health_pb2.HealthCheckResponse.SERVING
    stack.publish(TOOLS[:30])
    wait_health(stack.decoder_addr, stack.decoder)
    version, names = stack.discover("what's the weather in Paris", 3)
    assert len(set(names)) == 3 and set(names) <= {t["name"] for t in TOOLS[:30]}
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_port}/metrics", timeout=5).read().decode()
    for name in ("tooltrie_decoder_queue_depth", 'tooltrie_discover_total{code="OK"}', "tooltrie_decoder_running_batch",
                 "tooltrie_time_to_first_pointer_seconds_count", "tooltrie_decode_step_seconds_count",
                 "tooltrie_decoder_kv_blocks_used", "tooltrie_decoder_steps_ahead", "tooltrie_decoder_steps_dropped",
                 "tooltrie_decoder_tokens_forced",
                 "tooltrie_catalog_versions_loaded", "tooltrie_catalog_swaps_total"):
        assert name in metrics, name


def run_clients(stack, threads, stop, answers, errors):
    def client(i):
        n = 0
        while not stop.is_set():
            try:
                answers.append(stack.discover(f"client {i} request {n} about travel and weather", 2))
            except Exception as e:  # noqa: BLE001 - asserted by the caller
                errors.append(e)
            n += 1
    workers = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    return workers


def test_hot_swap_under_load(stack):
    """20 new versions (adding and removing tools) and a rollback while clients stream: no request
    fails, and every answer's names belong to the version its Accepted event pinned."""
    names_of = {1: {t["name"] for t in TOOLS[:30]}}
    stop, answers, errors = threading.Event(), [], []
    workers = run_clients(stack, 4, stop, answers, errors)
    for n in range(20):
        tools = TOOLS[n % 7: 25 + n % 11] + [{"name": f"extra_{n}_{i}", "description": "new"} for i in range(n % 3)]
        version = stack.publish(tools)
        names_of[version] = {t["name"] for t in tools}
        time.sleep(0.15)
    # the newest supersedes the warm-ups still in progress and becomes the default
    wait_until(lambda: answers and answers[-1][0] == version, 60, "the newest version answering")
    rollback_to = version - 3
    stack.compiler_stub.SetLatest(cpb.SetLatestRequest(name="demo", version=rollback_to), timeout=10)
    wait_until(lambda: len(answers) >= 200 and answers[-1][0] == rollback_to, 120, "200 answers after rollback")
    stop.set()
    for w in workers:
        w.join()
    assert not errors, errors[:3]
    for version, names in answers:
        assert len(set(names)) == 2 and set(names) <= names_of[version], (version, names)
    assert len({v for v, _ in answers}) >= 3  # requests really were served by several versions


def test_redis_restart_under_load(stack):
    """Redis goes away: loaded versions keep serving. It comes back: publishing works, and a version
    published before the decoder has resubscribed is picked up by its reconciliation."""
    stop, answers, errors = threading.Event(), [], []
    workers = run_clients(stack, 3, stop, answers, errors)
    stack.redis.stop()
    served_during_outage = len(answers)
    time.sleep(2.0)
    assert len(answers) > served_during_outage  # still answering without Redis
    stack.redis.start()
    version = None
    deadline = time.monotonic() + 30
    while version is None:
        try:
            version = stack.publish(TOOLS[40:70])
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline
            time.sleep(0.2)
    wait_until(lambda: answers and answers[-1][0] == version, 60, "the decoder to serve the new version")
    stop.set()
    for w in workers:
        w.join()
    assert not errors, errors[:3]


def test_cancellation_and_deadlines_free_every_block(stack):
    def info():
        return stack.decoder_stub.GetInfo(pb.GetInfoRequest(), timeout=10)

    wait_until(lambda: all(c.active_requests == 0 for c in info().catalogs), 30, "no active requests")
    idle = info().kv_free_blocks
    for _ in range(5):
        call = stack.decoder_stub.Discover(pb.DiscoverRequest(catalog="demo", intent="cancel me", k=3), timeout=30)
        next(call)
        call.cancel()
    for _ in range(5):
        with pytest.raises(grpc.RpcError) as err:
            stack.discover("too slow " * 50, 3, timeout=0.002)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: info().kv_free_blocks == idle, 30, "the KV pool to return to its idle level")


def test_get_info_describes_the_running_decoder(stack):
    info = stack.decoder_stub.GetInfo(pb.GetInfoRequest(), timeout=10)
    assert info.backend == "cpu" and info.device.startswith("cpu (") and info.model
    assert info.kv_capacity_tokens >= 65536 and info.kv_block_size == 16 and info.max_sequences >= 1
    assert any(c.name == "demo" and c.latest and c.ready for c in info.catalogs)


def test_sigterm_drains_in_flight_requests_then_exits(stack):
    results, errors = [], []

    def one(i):
        try:
            results.append(stack.discover(f"drain request {i}", 3))
        except grpc.RpcError as e:
            errors.append(e.code())
    workers = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for w in workers:
        w.start()
    time.sleep(0.05)
    stack.decoder.send_signal(signal.SIGTERM)
    for w in workers:
        w.join()
    assert stack.decoder.wait(timeout=30) == 0
    assert results, "no in-flight request finished"
    assert set(errors) <= {grpc.StatusCode.UNAVAILABLE}  # refused at the door, never cut off mid-answer

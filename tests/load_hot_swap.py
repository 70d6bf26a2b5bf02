"""Hot swap and a Redis restart under load, with real processes (redis-server, compiler, decoder on the
CPU backend with the tiny test model): the figures for issue 29. Not a test; run it by hand:

    .venv/bin/python tests/load_hot_swap.py --streams 16 --publishes 10 --every 5

Prints JSON: failed requests, each publish's time to its first answer, answers during a Redis outage.
"""
import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_e2e import TOOLS, Stack, wait_health
from tokenizer_fixtures import make_tokenizer_dir


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--publishes", type=int, default=10)
    p.add_argument("--every", type=float, default=5.0)
    p.add_argument("--outage", type=float, default=5.0)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp())
    from model_fixtures import make_serving_model
    model = make_serving_model(tmp / "model", make_tokenizer_dir(tmp / "tok"))
    stack = Stack(tmp, model)
    stack.publish(TOOLS[:30])
    wait_health(stack.decoder_addr, stack.decoder)
    lock, stop = threading.Lock(), threading.Event()
    answers, failures, first = [], [], {}

    def client(i):
        n = 0
        while not stop.is_set():
            try:
                version, names = stack.discover(f"client {i} request {n} travel weather", 2)
                now = time.monotonic()
                with lock:
                    answers.append((now, version))
                    first.setdefault(version, now)
            except Exception as e:  # noqa: BLE001 - counted
                code, detail = (e.code(), e.details()) if hasattr(e, "details") else ("", str(e))
                with lock:
                    failures.append(f"{type(e).__name__}: {code} {detail}"[:200])
            n += 1
    workers = [threading.Thread(target=client, args=(i,)) for i in range(args.streams)]
    for w in workers:
        w.start()
    time.sleep(2)
    published = {}
    for n in range(args.publishes):
        tools = TOOLS[n % 7: 25 + n % 11] + [{"name": f"extra_{n}", "description": "new"}]
        v = stack.publish(tools)
        published[v] = time.monotonic()
        time.sleep(args.every)
    last = max(published)
    deadline = time.monotonic() + 60
    while last not in first and time.monotonic() < deadline:
        time.sleep(0.1)
    hot_failures = len(failures)
    # Redis restart mid-load
    before = len(answers)
    t0 = time.monotonic()
    stack.redis.stop()
    time.sleep(args.outage)
    during = len(answers) - before
    stack.redis.start()
    time.sleep(3)
    v_after = stack.publish(TOOLS[3:28])
    t_pub = time.monotonic()
    deadline = time.monotonic() + 60
    while v_after not in first and time.monotonic() < deadline:
        time.sleep(0.1)
    stop.set()
    for w in workers:
        w.join()
    stack.stop()
    print(json.dumps({
        "streams": args.streams, "publishes": args.publishes, "every_s": args.every,
        "answers": len(answers), "failed_during_hot_swap": hot_failures,
        "publish_to_first_answer_s": {v: round(first[v] - t, 2) if v in first else None
                                      for v, t in sorted(published.items())},
        "redis_outage_s": args.outage, "answers_during_outage": during,
        "failed_during_outage_and_after": len(failures) - hot_failures,
        "publish_after_restart_to_first_answer_s": round(first[v_after] - t_pub, 2) if v_after in first else None,
        "failures": failures[:5], "wall_s": round(time.monotonic() - t0, 1)}, indent=1))


if __name__ == "__main__":
    main()

"""Does the decode-graph cache evict? A bench run with CudaBackend.forward counted (GPU only).

    python3 bench/graph_cache.py [python3 -m bench's arguments, e.g. --shapes smollm2-135m --no-peer --rows 1
                                  --det-seconds 0]

Runs the bench as it is, and prints at the end how many graphs forward() captured, for how many
distinct keys (`CudaBackend.graph_key`), and the most it held at once: captures above the distinct
keys are graphs evicted (max_graphs) and captured again (perf log g2: gated and ungated steps of the
same shape are two graphs).
"""
from __future__ import annotations

import atexit
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from decoder_service.model.cuda.backend import CudaBackend  # noqa: E402


def main() -> None:
    keys, captures, held, inside = set(), [0], [0], [False]
    forward, capture = CudaBackend.forward, CudaBackend.capture

    def counted_capture(self, fn, gate=None):
        captures[0] += inside[0]      # forward's captures only (the bench's step table captures its own)
        return capture(self, fn, gate)

    def counted_forward(self, batch, device_tokens=None, skip_if_done=None):
        inside[0] = True
        try:
            forward(self, batch, device_tokens, skip_if_done)
        finally:
            inside[0] = False
        if batch.decode_rows == batch.num_rows <= self.graph_rows:
            keys.add(self.graph_key(batch.num_rows, len(batch.logit_rows), skip_if_done))
        held[0] = max(held[0], self.num_graphs)

    CudaBackend.forward, CudaBackend.capture = counted_forward, counted_capture
    atexit.register(lambda: print(f"decode graphs: {captures[0]} captured for {len(keys)} distinct keys, "
                                  f"at most {held[0]} held", flush=True))
    sys.argv = ["bench", *sys.argv[1:]]
    runpy.run_module("bench", run_name="__main__")


if __name__ == "__main__":
    main()

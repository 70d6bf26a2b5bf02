"""Which attention kernel takes each row (decoder_service.model.cuda.plan.attention_plan): the row's
kind and position decide, never its batch mates; prompt rows from `tile_from` on go in row tiles, each
tile's rows at one split of their context (prompt_split), a function of the position alone."""
import numpy as np

from decoder_service.model.batch import StepBatch
from decoder_service.model.cuda.plan import attention_plan, prompt_split
from decoder_service.model.cuda.attention import TP


def _plan(chunks, decode_rows, tile_from=10, rows_per_tile=3, split=TP, most_splits=64):
    batch = StepBatch.from_chunks(chunks, np.zeros((4, 8), np.int32), decode_rows)
    return attention_plan(batch, int(batch.positions.max()) + 1, tile_from, rows_per_tile, split, most_splits, TP)


def test_decode_rows_and_early_prompt_rows_go_one_at_a_time_later_prompt_rows_in_tiles():
    # row 0: a decode row past the threshold; rows 1..8: a chunk at positions 6..13 straddling it;
    # rows 9..10: another sequence's chunk at 20..21
    rows, tiles = _plan([(0, [1], 30), (1, list(range(8)), 6), (2, [1, 2], 20)], decode_rows=1)
    assert rows.tolist() == [0, 1, 2, 3, 4]
    # cut every 3 rows, and where the sequence changes
    assert tiles.tolist() == [[5, 3, TP], [8, 1, TP], [9, 2, TP]]


def test_a_step_of_decode_rows_or_short_contexts_has_no_tiles():
    rows, tiles = _plan([(0, [1], 30), (1, [2], 40)], decode_rows=2)
    assert rows.tolist() == [0, 1] and tiles.shape == (0, 3)
    rows, tiles = _plan([(1, list(range(5)), 0)], decode_rows=0)
    assert rows.tolist() == [0, 1, 2, 3, 4] and tiles.shape == (0, 3)


def test_a_rows_tile_does_not_span_a_gap_in_positions():
    rows, tiles = _plan([(1, [1, 2], 10), (1, [3, 4], 14)], decode_rows=0)
    assert rows.size == 0 and tiles.tolist() == [[0, 2, TP], [2, 2, TP]]


def test_a_long_context_takes_longer_splits_so_that_it_has_at_most_most_splits():
    split = 4 * TP
    assert prompt_split(1, split, 3, TP) == split                     # a short context keeps the model's split
    assert prompt_split(12 * TP, split, 3, TP) == split               # 3 splits of 4 TP
    assert prompt_split(12 * TP + 1, split, 3, TP) == 5 * TP          # 3 splits of 5 TP (4 TP would take 4)
    assert prompt_split(15 * TP + 1, split, 3, TP) == 6 * TP
    for n in range(1, 40 * TP):
        s = prompt_split(n, split, 3, TP)
        assert s % TP == 0 and s >= split and -(-n // s) <= 3
        assert s == split or -(-n // (s - TP)) > 3                # the least such multiple of TP


def test_a_rows_tile_does_not_span_two_splits():
    # a chunk at positions 12 TP - 2 .. 12 TP + 5: contexts up to 12 TP keep 4 TP, then 3 splits of 5 TP
    rows, tiles = _plan([(1, list(range(8)), 12 * TP - 2)], decode_rows=0, tile_from=0, rows_per_tile=4,
                        split=4 * TP, most_splits=3)
    assert tiles.tolist() == [[0, 2, 4 * TP], [2, 4, 5 * TP], [6, 2, 5 * TP]]


def test_random_batches_cut_every_run_of_rows_into_tiles():
    """Against the rule written plainly: tiled rows form runs (next row, same slot, next position, same
    split), and each run is cut into tiles of rows_per_tile rows, the last one shorter."""
    rng = np.random.default_rng(5)
    for _ in range(300):
        # chunks start a few rows before a multiple of TP, where prompt_split may change
        decode = [(int(rng.integers(4)), [1], int(rng.integers(8 * TP))) for _ in range(rng.integers(3))]
        prompts = [(int(rng.integers(4)), [1] * int(rng.integers(1, 10)),
                    int(TP * rng.integers(1, 8) - rng.integers(10))) for _ in range(rng.integers(1, 4))]
        tile_from, per_tile = int(rng.integers(0, 8 * TP)), int(rng.integers(1, 5))
        split, most = TP * int(rng.integers(1, 4)), int(rng.integers(1, 5))
        batch = StepBatch.from_chunks(decode + prompts, np.zeros((4, 8), np.int32), len(decode))
        tiled = [i for i in range(batch.num_rows) if i >= len(decode) and batch.positions[i] >= tile_from]
        own = {i: prompt_split(int(batch.positions[i]) + 1, split, most, TP) for i in tiled}
        runs = []
        for i in tiled:
            if runs and runs[-1][-1] == i - 1 and batch.slots[i] == batch.slots[i - 1] \
                    and batch.positions[i] == batch.positions[i - 1] + 1 and own[i] == own[i - 1]:
                runs[-1].append(i)
            else:
                runs.append([i])
        want = [[run[j], len(run[j:j + per_tile]), own[run[j]]]
                for run in runs for j in range(0, len(run), per_tile)]
        rows, tiles = attention_plan(batch, int(batch.positions.max()) + 1, tile_from, per_tile, split, most, TP)
        assert tiles.tolist() == want
        assert rows.tolist() == [i for i in range(batch.num_rows) if i not in tiled]


_STEPS_AFTER_THE_HELPERS = """
import json
import numpy as np
from decoder_service.model.batch import StepBatch, _first_fault
from decoder_service.model.cuda.plan import _cut_tiles, attention_plan, compile_step_helpers
from decoder_service.model.cuda.attention import TP
compile_step_helpers(16, 64, 1000, 3, TP, 64)
compiled = (len(_first_fault.signatures), len(_cut_tiles.signatures))
tables = np.zeros((2, 4), np.int32)
prompt = StepBatch.from_chunks([(0, [5], 40), (1, list(range(7)), 0)], tables, 1)
rows = np.arange(2, dtype=np.int32)
ahead = StepBatch(tokens=np.zeros(2, np.int32), slots=rows, positions=np.array([41, 7], np.int32),
                  block_tables=tables, logit_rows=rows, decode_rows=2)
for batch in (prompt, ahead):
    batch.validate(16, 64, 1000)
    attention_plan(batch, int(batch.positions.max()) + 1, 4, 3, TP, 64, TP)
print(json.dumps([compiled, (len(_first_fault.signatures), len(_cut_tiles.signatures))]))
"""


def test_the_backend_compiles_a_steps_host_helpers_before_its_first_step():
    """CudaBackend's constructor runs compile_step_helpers, so that a catalog's warm-up (the first step)
    never waits for numba to compile the batch check or the tile search: in a fresh process, a prompt
    step and a step of decode rows built as the engine builds them (one planned, one launched ahead)
    compile nothing more."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", _STEPS_AFTER_THE_HELPERS], cwd=root, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    helpers, after_steps = json.loads(out.stdout.strip().splitlines()[-1])
    assert helpers == after_steps and min(helpers) > 0, out.stdout

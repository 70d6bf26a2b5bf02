"""Which attention kernel takes each row (decoder_service.model.cuda.backend.attention_plan): the row's
kind and position decide, never its batch mates; prompt rows from `tile_from` on go in row tiles."""
import numpy as np

from decoder_service.model.batch import StepBatch
from decoder_service.model.cuda.backend import attention_plan


def _plan(chunks, decode_rows, tile_from=10, rows_per_tile=3):
    batch = StepBatch.from_chunks(chunks, np.zeros((4, 8), np.int32), decode_rows)
    return attention_plan(batch, int(batch.positions.max()) + 1, tile_from, rows_per_tile)


def test_decode_rows_and_early_prompt_rows_go_one_at_a_time_later_prompt_rows_in_tiles():
    # row 0: a decode row past the threshold; rows 1..8: a chunk at positions 6..13 straddling it;
    # rows 9..10: another sequence's chunk at 20..21
    rows, tiles = _plan([(0, [1], 30), (1, list(range(8)), 6), (2, [1, 2], 20)], decode_rows=1)
    assert rows.tolist() == [0, 1, 2, 3, 4]
    assert tiles.tolist() == [[5, 3], [8, 1], [9, 2]]   # cut every 3 rows, and where the sequence changes


def test_a_step_of_decode_rows_or_short_contexts_has_no_tiles():
    rows, tiles = _plan([(0, [1], 30), (1, [2], 40)], decode_rows=2)
    assert rows.tolist() == [0, 1] and tiles.shape == (0, 2)
    rows, tiles = _plan([(1, list(range(5)), 0)], decode_rows=0)
    assert rows.tolist() == [0, 1, 2, 3, 4] and tiles.shape == (0, 2)


def test_a_rows_tile_does_not_span_a_gap_in_positions():
    rows, tiles = _plan([(1, [1, 2], 10), (1, [3, 4], 14)], decode_rows=0)
    assert rows.size == 0 and tiles.tolist() == [[0, 2], [2, 2]]


def test_random_batches_cut_every_run_of_rows_into_tiles():
    """Against the rule written plainly: tiled rows form runs (next row, same slot, next position), and
    each run is cut into tiles of rows_per_tile rows, the last one shorter."""
    rng = np.random.default_rng(5)
    for _ in range(300):
        decode = [(int(rng.integers(4)), [1], int(rng.integers(40))) for _ in range(rng.integers(3))]
        prompts = [(int(rng.integers(4)), [1] * int(rng.integers(1, 10)), int(rng.integers(30)))
                   for _ in range(rng.integers(1, 4))]
        tile_from, per_tile = int(rng.integers(0, 12)), int(rng.integers(1, 5))
        batch = StepBatch.from_chunks(decode + prompts, np.zeros((4, 8), np.int32), len(decode))
        tiled = [i for i in range(batch.num_rows) if i >= len(decode) and batch.positions[i] >= tile_from]
        runs = []
        for i in tiled:
            if runs and runs[-1][-1] == i - 1 and batch.slots[i] == batch.slots[i - 1] \
                    and batch.positions[i] == batch.positions[i - 1] + 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        want = [[run[j], len(run[j:j + per_tile])] for run in runs for j in range(0, len(run), per_tile)]
        rows, tiles = attention_plan(batch, int(batch.positions.max()) + 1, tile_from, per_tile)
        assert tiles.tolist() == want
        assert rows.tolist() == [i for i in range(batch.num_rows) if i not in tiled]

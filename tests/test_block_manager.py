"""The KV pool's block bookkeeping: allocation, the shared prefix's reference counts, release."""
import numpy as np
import pytest

from decoder_service.engine.block_manager import BlockManager


def test_allocate_takes_the_oldest_free_blocks_and_refuses_past_the_pool():
    bm = BlockManager(8)
    assert bm.allocate(3) == [0, 1, 2]
    assert bm.num_free == 5
    with pytest.raises(MemoryError, match="6 KV blocks asked for, 5 free"):
        bm.allocate(6)
    assert bm.num_free == 5


def test_shared_prefix_blocks_return_only_when_the_last_holder_releases():
    bm = BlockManager(8)
    prefix = np.asarray(bm.allocate(3), np.int32)     # the catalog's warm-up holds them
    bm.share(prefix)                                  # two requests on the catalog
    bm.share(prefix)
    bm.release(prefix)
    bm.release(prefix)
    assert bm.num_free == 5 and list(bm.refs[:3]) == [1, 1, 1]
    bm.release(prefix)                                # the version is dropped
    assert bm.num_free == 8 and not bm.refs.any()


def test_released_blocks_go_back_in_the_order_given():
    bm = BlockManager(6)
    own = bm.allocate(4)
    bm.release([own[2], own[0], own[3], own[1]])
    assert list(bm.free) == [4, 5, 2, 0, 3, 1]
    assert bm.allocate(3) == [4, 5, 2]


def test_releasing_a_block_more_often_than_held_raises_and_changes_nothing():
    bm = BlockManager(4)
    a = bm.allocate(2)
    bm.release(a)
    before, free = bm.refs.copy(), list(bm.free)
    with pytest.raises(RuntimeError, match="KV block 0 released more often than held"):
        bm.release(a)
    assert np.array_equal(bm.refs, before) and list(bm.free) == free


def test_releasing_nothing_is_a_no_op():
    bm = BlockManager(2)
    bm.release([])
    bm.release(np.empty(0, np.int32))
    assert bm.num_free == 2

"""Where the block pool places a request's blocks: runs forward in memory where it can, without
taking a recently freed block (likelier a prefix-cache hit) out of its LRU turn."""

from __future__ import annotations

import torch

from daemon.kv.block_pool import BlockPool
from daemon.kv.manager import KVManager
from daemon.kv.spec import FullAttentionSpec, KVGroup

SPEC = FullAttentionSpec(
    block_size=4, num_layers=1, dtype=torch.float32, num_kv_heads=1, head_dim=2
)


def _kv(num_blocks: int) -> KVManager:
    return KVManager([KVGroup(SPEC, (0,))], num_blocks * SPEC.bytes_per_block)


def _three_requests() -> BlockPool:
    """A holds 0-1, B held 2-3 and C held 4-15; B, then C, finished (tail first each)."""
    pool = BlockPool(16)
    assert pool.allocate(2) == [0, 1]
    b, c = pool.allocate(2), pool.allocate(12)
    for block in reversed(b + c):  # C's tail first ... B's head last
        pool.decref(block)
    return pool


def test_a_growing_request_continues_its_last_block_when_that_one_is_old_and_free() -> None:
    pool = BlockPool(16)
    pool.allocate(2)  # A: 0, 1
    b, c = pool.allocate(2), pool.allocate(12)
    for block in reversed(b):  # B finished first: its blocks are the oldest free ones
        pool.decref(block)
    for block in reversed(c):
        pool.decref(block)
    # the LRU's head is 3 (B's tail); A's next block in memory, 2, was freed right after it
    assert pool.allocate(1, after=1) == [2]
    assert pool.allocate(1, after=2) == [3]
    # 4, C's head, was freed last: it keeps its turn, and the LRU gives 15, 14, 13 ascending
    assert pool.allocate(3, after=3) == [13, 14, 15]


def test_a_run_takes_no_block_with_content_while_an_empty_one_is_left() -> None:
    taken: list[int] = []
    pool = BlockPool(16, on_reuse=taken.append)
    pool.allocate(2)  # A: 0, 1
    b = pool.allocate(2)  # B: 2, 3, freed head first: 2 is the oldest block with content
    for block in b:
        pool.decref(block)
    taken.clear()
    # 4-15 never held anything: A grows into them, and B's blocks stay for a prefix hit
    assert pool.allocate(2, after=1) == [4, 5]
    assert taken == [4, 5]


def test_a_recently_freed_neighbour_keeps_its_turn() -> None:
    pool = _three_requests()  # freed 15 .. 4 (C), then 3, 2 (B): 2 is the newest free block
    assert pool.allocate(1, after=1) == [15]  # the LRU's head, not block 2


def test_without_a_last_block_an_allocation_takes_the_lrus_head_and_runs_on_from_it() -> None:
    pool = BlockPool(8)
    assert pool.allocate(8) == list(range(8))
    for block in (5, 0, 1, 6, 2, 3, 4, 7):
        pool.decref(block)
    # 5 is the LRU's head and 6, in the older half, follows it (the LRU's order would give
    # 1 next); 7 is the newest, so then the LRU's next, 0
    assert pool.allocate(3) == [0, 5, 6]


def test_the_continuing_blocks_come_first_and_the_rest_ascending() -> None:
    pool = BlockPool(12)
    held = pool.allocate(12)
    for block in (9, 8, 7, 2, 1, 0, 10, 11):  # 3-6 stay held
        pool.decref(block)
    assert set(held) == set(range(12))
    # after 6: 7, 8 and 9 (old) continue it; 10 is newer, so the LRU's head, 2, comes last
    assert pool.allocate(4, after=6) == [7, 8, 9, 2]


def test_the_kv_manager_grows_a_table_forward_in_memory() -> None:
    kv = _kv(16)
    assert kv.grow("a", 8) and kv.grow("b", 8) and kv.grow("c", 40) and kv.grow("d", 8)
    for name in ("d", "b", "c"):  # d's blocks, 14 and 15, head the LRU
        kv.free(name)
    assert kv.grow("a", 16)
    assert kv.block_tables("a") == [[0, 1, 2, 3]]


def test_a_request_grows_back_into_the_block_its_rejected_drafts_gave_back() -> None:
    kv = _kv(8)
    assert kv.grow("a", 8) and kv.grow("a", 12)  # drafts past a block boundary: block 2
    assert kv.grow("b", 8)  # 3, 4
    kv.free("b")
    kv.shrink("a", 8)  # the drafts were rejected: block 2 is freed last of all
    assert kv.grow("a", 12)
    assert kv.block_tables("a") == [[0, 1, 2]]  # not the LRU's head, 5

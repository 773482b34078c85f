"""KV spec kinds: each spec class gets its kind's manager; the KV manager sizes pools by kind
and hands over the sliding-window group by its class."""

from __future__ import annotations

import torch

from daemon.kv.kinds import PagedManager, PerRequestManager, SlidingWindowManager, manager_for
from daemon.kv.manager import KVManager, pool_sizes
from daemon.kv.spec import (
    CompressedKVSpec,
    CompressorStateSpec,
    FullAttentionSpec,
    KVGroup,
    SlidingWindowSpec,
)

B = 16
SWA = SlidingWindowSpec(B, 2, torch.float32, "swa", 1000)
STATE = CompressorStateSpec(B, 2, torch.float32, "state", 500)
CSA = CompressedKVSpec(B, 1, torch.float32, "csa", 300)
HCA = CompressedKVSpec(B, 1, torch.float32, "hca", 100)


def test_each_kind_has_its_manager() -> None:
    assert type(manager_for(SWA)) is SlidingWindowManager
    assert type(manager_for(STATE)) is PerRequestManager
    assert type(manager_for(CSA)) is PagedManager
    assert type(manager_for(FullAttentionSpec(B, 2, torch.float32, 2, 8))) is PagedManager
    assert [manager_for(s).blocks_for(33) for s in (SWA, STATE, CSA)] == [1, 1, 3]
    assert SWA.per_request and STATE.per_request and not CSA.per_request
    assert [s.name for s in (SWA, STATE, CSA, HCA)] == ["swa", "state", "csa", "hca"]


def test_pools_by_kind_and_the_sliding_window_group() -> None:
    groups = [KVGroup(s, (0,)) for s in (STATE, CSA, SWA, HCA)]
    memory = 3 * (1000 + 500) + 10 * (300 + 100)
    assert pool_sizes(groups, memory, max_num_seqs=3) == [3, 10, 3, 10]
    kv = KVManager(groups, memory, max_num_seqs=3)
    assert kv.num_blocks == [3, 10, 3, 10] and kv.paged == [1, 3] and kv.swa_group == 2
    assert kv.grow("a", 20) and kv.swa_block("a") == kv.block_tables("a")[2][0]
    dense = KVManager([KVGroup(CSA, (0,))], 10 * 300)
    assert dense.swa_group is None

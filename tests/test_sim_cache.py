"""Cache fidelity: with room for everything, the simulated prefix hit rate on a Mooncake-format
trace equals the trace's own ceiling, computed here from the trace alone; each node runs the
daemon's own Scheduler, KV manager and prefix cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from daemon.kv.manager import KVManager
from daemon.kv.prefix import PrefixCache
from daemon.loop.scheduler import Scheduler
from daemon.sim.cluster import ClusterConfig, simulate
from daemon.sim.node import NodeConfig
from daemon.sim.result import summarize
from daemon.sim.trace import read_trace
from tests.sim_traces import ceiling, conversations, table, write_trace

# the shared traces sit beside the checkout (../shared), as the README says
REAL_TRACE = Path(__file__).resolve().parents[2] / "shared/traces/conversation_trace.jsonl"
MB = 2**20


def run(lines: list[dict], tmp_path: Path, node: NodeConfig, store_bytes: float = 0.0):
    trace = read_trace(write_trace(lines, tmp_path))
    # arrivals far apart: each request has left before the next comes (the ceiling's order)
    cfg = ClusterConfig(1, node, store_bytes, time_scale=1000.0)
    return simulate(table(), trace, cfg, progress=False)


TIERS = {  # device KV: room for every block, or for a few requests (evicted blocks move down)
    "device": (NodeConfig(64 * MB, 0, 8, 2048), 0.0),
    "host": (NodeConfig(4 * MB, float("inf"), 8, 2048), 0.0),
    "store": (NodeConfig(4 * MB, 0, 8, 2048), float("inf")),
}


@pytest.mark.parametrize("tier", TIERS)
def test_generated_trace_hits_its_ceiling(tier: str, tmp_path: Path) -> None:
    lines = conversations()
    node, store = TIERS[tier]
    sim = run(lines, tmp_path, node, store)
    summary = summarize(sim)
    assert summary["finished"] == len(lines)
    want = ceiling(lines)
    assert want > 0.3  # the trace shares prefixes
    assert summary["prefix"]["hit_rate"] == pytest.approx(want, abs=1e-12)
    by_tier = summary["prefix"]["hit_rate_by_tier"]
    assert by_tier[tier] > 0.01  # the tier under test served hits
    node_ = sim.nodes[0]
    assert type(node_.scheduler) is Scheduler  # the daemon's own, not a model of it
    assert type(node_.prefix) is PrefixCache and type(node_.kv) is KVManager
    if tier == "store":
        assert summary["store_bytes"]["read"] > 0
        assert summary["store_bytes"]["written"] >= summary["store_bytes"]["read"] / 4


@pytest.mark.skipif(not REAL_TRACE.exists(), reason="the conversation trace is not here")
def test_real_trace_slice_hits_its_ceiling(tmp_path: Path) -> None:
    """The first 300 requests of Mooncake's conversation trace (outputs cut to 2 tokens)."""
    with REAL_TRACE.open() as f:
        lines = [json.loads(next(f)) for _ in range(300)]
    for line in lines:
        line["output_length"] = 2
    summary = summarize(run(lines, tmp_path, NodeConfig(2048 * MB, 0, 8, 2048)))
    assert summary["finished"] == len(lines)
    want = ceiling(lines)
    assert want > 0.05
    assert summary["prefix"]["hit_rate"] == pytest.approx(want, abs=1e-12)


def test_a_too_small_cache_misses(tmp_path: Path) -> None:
    """The check can fail: device KV for half the largest request, no lower tier: misses
    (and refuses the requests it cannot hold)."""
    lines = conversations()
    summary = summarize(run(lines, tmp_path, NodeConfig(2 * MB, 0, 8, 2048)))
    assert summary["prefix"]["hit_rate"] < ceiling(lines) - 0.05

"""The simulator's decode runs between events (SimNode.steady_steps / run_steady) give the
same result, field for field, as one event per step, on a trace that shares prefixes, runs
out of KV memory (preemptions, refusals) and reads the store; and they do skip steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.sim.cluster import ClusterConfig, simulate
from daemon.sim.node import NodeConfig
from daemon.sim.result import summarize
from daemon.sim.trace import block_tokens, read_trace
from tests.sim_traces import conversations, table, write_trace

MB = 2**20


def result(tmp_path: Path, cfg: ClusterConfig, step_by_step: bool) -> tuple[dict, int, int]:
    trace = read_trace(
        write_trace(conversations(seed=3, sessions=16, turns=4, outputs=40), tmp_path)
    )
    run = simulate(table(), trace, cfg, progress=False, step_by_step=step_by_step)
    out = summarize(run)
    out.pop("wall_s")
    return out, sum(n.counters.steps for n in run.nodes), run.events


@pytest.mark.parametrize(
    "cfg",
    [
        ClusterConfig(2, NodeConfig(8 * MB, 16 * MB, 8, 256), float("inf"), "prefix-affinity", 0.2),
        ClusterConfig(3, NodeConfig(2 * MB, 0, 6, 128), 4 * MB, "least-loaded", 0.05),
    ],
    ids=["roomy", "short-of-kv"],
)
def test_decode_runs_change_nothing(cfg: ClusterConfig, tmp_path: Path) -> None:
    fast, steps, events = result(tmp_path, cfg, step_by_step=False)
    slow, slow_steps, slow_events = result(tmp_path, cfg, step_by_step=True)
    assert fast == slow
    assert steps == slow_steps  # every step is counted, taken at once or not
    assert fast["finished"] > 0 and fast["prefix"]["hit_rate"] > 0
    if cfg.node.host_bytes:  # room for all: many steps were taken at once
        assert events < 0.8 * slow_events
    else:
        sum(n["preemptions"] for n in fast["per_node"]) > 0 and fast["rejected"] > 0


def test_block_tokens_are_cached_and_exact() -> None:
    ids = block_tokens(123_456_789, 2**16)
    j = 100
    step = 1 + 123_456_789 % 7919
    assert ids[3 + j] == (123_456_789 + step * j) % 2**16 and len(ids) == 512
    assert block_tokens(123_456_789, 2**16) is ids

"""MoE nodes in the simulator: skewed routing stretches steps by the expert-parallel imbalance,
the daemon's own placement code (moe/controller.replan) rebalances on the daemon's schedule,
which lowers the imbalance and raises throughput; decode runs taken at once change nothing;
`deepinfer simulate --moe-*` reports it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.moe import controller
from daemon.moe.controller import MoEController
from daemon.sim import moe as sim_moe
from daemon.sim.cluster import ClusterConfig, simulate
from daemon.sim.moe_config import MoEConfig
from daemon.sim.node import NodeConfig
from daemon.sim.result import summarize
from daemon.sim.trace import TraceRequest
from tests.daemons import checkout_env
from tests.sim_traces import table, write_trace

MB = 2**20
ROOT = Path(__file__).resolve().parents[1]


def trace(n: int = 32, output: int = 200) -> list[TraceRequest]:
    return [TraceRequest(0.01 * i, 64, output, (1000 * i,)) for i in range(n)]


def config(rebalance: int, zipf: float = 1.2, drift: float = 0.0) -> ClusterConfig:
    moe = MoEConfig(
        experts=32, experts_per_token=4, ranks=8, layers=2, zipf=zipf, drift=drift,
        stats_interval=20, rebalance_interval=rebalance,
    )  # fmt: skip
    return ClusterConfig(1, NodeConfig(64 * MB, 0, 32, 2048, moe))


def test_rebalancing_lowers_the_imbalance_and_raises_throughput() -> None:
    off = summarize(simulate(table(), trace(), config(0), progress=False))
    on = summarize(simulate(table(), trace(), config(100), progress=False))
    assert off["moe"]["rebalances"] == 0 and on["moe"]["rebalances"] == 2
    # skewed routing on the initial (even-load) placement: the busiest rank well above the mean
    assert off["moe"]["step_imbalance_before_first_rebalance"] > 1.5
    assert off["moe"]["step_imbalance_after_first_rebalance"] is None
    before = on["moe"]["step_imbalance_before_first_rebalance"]
    after = on["moe"]["step_imbalance_after_first_rebalance"]
    assert after < before - 0.3
    first = on["moe"]["per_node"][0]["log"][0]
    assert first["step"] == 100 and first["moved_slots"] > 0
    assert first["imbalance_after"] < 1.2 < first["imbalance_before"]
    assert on["moe"]["stretch_s"] < off["moe"]["stretch_s"]
    assert on["throughput"]["output_tok_s"] > 1.05 * off["throughput"]["output_tok_s"]
    assert on["simulated_s"] < off["simulated_s"]


def test_even_routing_leaves_little_to_rebalance() -> None:
    skewed = summarize(simulate(table(), trace(), config(0), progress=False))
    even = summarize(simulate(table(), trace(), config(0, zipf=0.0), progress=False))
    e, s = even["moe"], skewed["moe"]
    assert e["step_imbalance_before_first_rebalance"] < s["step_imbalance_before_first_rebalance"]
    assert even["throughput"]["output_tok_s"] > skewed["throughput"]["output_tok_s"]


def test_the_simulator_places_with_the_daemons_function(monkeypatch: pytest.MonkeyPatch) -> None:
    # the controller's rebalance and the simulator's go through the same module function
    assert sim_moe.controller is controller
    assert "replan" in MoEController._rebalance.__code__.co_names
    assert "decide" in MoEController.schedule.__code__.co_names
    real, made = controller.replan, []

    def spy(*args: object, **kwargs: object) -> list:
        made.append(real(*args, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    monkeypatch.setattr(controller, "replan", spy)
    run = simulate(table(), trace(), config(100), progress=False)
    experts = run.nodes[0].experts
    assert experts is not None
    assert len(made) == experts.counters.rebalances == 2
    assert experts.placements is made[-1]


def test_decode_runs_taken_at_once_change_nothing() -> None:
    cfg = config(40, drift=0.5)
    fast, slow = (
        summarize(simulate(table(), trace(16, 80), cfg, progress=False, step_by_step=s))
        for s in (False, True)
    )
    for r in (fast, slow):
        del r["wall_s"]
    assert fast["moe"]["rebalances"] >= 2
    assert fast == slow


def test_a_moe_config_that_cannot_be_placed_is_refused() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        MoEConfig(experts=64, ranks=4, slots_per_rank=8)
    with pytest.raises(ValueError, match="experts per token"):
        MoEConfig(experts=8, experts_per_token=9)


def deepinfer(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "daemon", *args],
        cwd=ROOT, env=checkout_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_simulate_moe_flags(tmp_path: Path) -> None:
    lines = [
        {"timestamp": 0, "input_length": 100, "output_length": 100, "hash_ids": [i]}
        for i in range(24)
    ]
    path = write_trace(lines, tmp_path)
    out = tmp_path / "r.json"
    done = deepinfer(
        "simulate", "--trace", str(path), "--out", str(out), "--no-progress",
        "--moe-experts", "32", "--moe-experts-per-token", "4", "--moe-ep-ranks", "8",
        "--moe-zipf", "1.2", "--moe-stats-interval", "10", "--moe-rebalance-interval", "30",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    moe = json.loads(out.read_text())["moe"]
    assert moe["rebalances"] >= 1 and "MoE: " in done.stdout
    assert (
        moe["step_imbalance_after_first_rebalance"] < moe["step_imbalance_before_first_rebalance"]
    )
    bad = deepinfer(
        "simulate", "--trace", str(path), "--out", str(out), "--moe-experts", "8",
        "--moe-experts-per-token", "9",
    )  # fmt: skip
    assert bad.returncode == 2 and "--moe-*" in bad.stderr and "Traceback" not in bad.stderr

"""Hit rate against capacity: `sweep` runs the trace at each host-memory and store capacity;
with too little room the hit rate falls below the trace's ceiling, with an unlimited host
tier it reaches it (computed from the trace alone); the CLI writes the curve (a store's)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.sim.cluster import ClusterConfig
from daemon.sim.commands import _sizes
from daemon.sim.node import NodeConfig
from daemon.sim.sweep import sweep
from daemon.sim.trace import read_trace
from tests.daemons import checkout_env
from tests.sim_traces import ceiling, interleaved, table, write_trace

MB = 2**20
INF = float("inf")


def test_the_curve_rises_to_the_ceiling(tmp_path: Path) -> None:
    lines = interleaved(sessions=6)
    trace = read_trace(write_trace(lines, tmp_path))
    # arrivals far apart (each request leaves before the next): the ceiling's order
    cfg = ClusterConfig(1, NodeConfig(4 * MB, 0, 8, 2048), time_scale=1000.0)
    # a host tier a quarter of device memory: an LRU of 1/8 catches almost nothing of this
    # cyclic order (0-0.3 % of hits, by how the pool places blocks)
    result = sweep(table(), trace, cfg, [0, 1 * MB, INF], [0], progress=False)
    assert result["host_gb_per_node"] == [0, 1 / 1024, "unlimited"]
    rates = {(p["host_gb_per_node"], p["store_gb"]): p["hit_rate"] for p in result["points"]}
    want = ceiling(lines)
    assert rates[(0, 0)] < want - 0.3  # device memory alone holds a turn's prefix no longer
    assert rates[(0, 0)] < rates[(1 / 1024, 0)] < rates[("unlimited", 0)]
    assert rates[("unlimited", 0)] == pytest.approx(want, abs=1e-12)
    assert result["points"][-1]["hit_rate_by_tier"]["host"] > 0.3


def test_the_cli_writes_the_curve(tmp_path: Path) -> None:
    trace = write_trace(interleaved(sessions=4, turns=3), tmp_path)
    table().save(tmp_path / "table.json")
    out = tmp_path / "curve.json"
    args = [
        "--trace", str(trace), "--table", str(tmp_path / "table.json"), "--device-kv-gb", "0.004",
        "--time-scale", "1000", "--sweep-host-gb", "0", "--sweep-store-gb", "0,inf",
        "--out", str(out), "--no-progress",
    ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "daemon", "simulate", *args],
        env=checkout_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [p["store_gb"] for p in result["points"]] == [0.0, "unlimited"]
    no_store, store = result["points"]
    assert store["hit_rate"] > no_store["hit_rate"] + 0.1
    assert store["hit_rate_by_tier"]["store"] > 0.1 and store["store_bytes"]["read"] > 0
    assert result["table"]["where"] == "test" and result["device_kv_gb_per_node"] == 0.004
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    for bad in ("1,x", "-1", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            _sizes(bad)
    assert _sizes("0, 16,inf") == [0, 16, INF]

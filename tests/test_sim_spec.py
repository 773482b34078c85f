"""Speculative decoding in the simulator: the daemon's Speculator and verify-length policies in
each node's Scheduler, verify rows priced as decodes from the table, accepted drafts drawn at
each request's rate: high acceptance cuts TPOT, acceptance 0 makes the adaptive policy draft
nothing (the fixed one drafts anyway, and pays for it); `deepinfer simulate --spec-*`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.loop.spec.policy import AdaptivePolicy, FixedPolicy
from daemon.loop.spec.speculator import Speculator
from daemon.sim.cluster import ClusterConfig, simulate
from daemon.sim.node import NodeConfig
from daemon.sim.result import summarize
from daemon.sim.spec_config import SpecConfig
from daemon.sim.trace import TraceRequest
from tests.daemons import checkout_env
from tests.sim_traces import table, write_trace

MB = 2**20
ROOT = Path(__file__).resolve().parents[1]


def run(spec: SpecConfig | None) -> dict:
    trace = [TraceRequest(1.0 * i, 64, 100, (1000 * i,)) for i in range(8)]
    cfg = ClusterConfig(1, NodeConfig(64 * MB, 0, 32, 2048, spec=spec))
    return summarize(simulate(table(), trace, cfg, progress=False))


def test_high_acceptance_cuts_tpot() -> None:
    plain, spec = run(None), run(SpecConfig(acceptance=0.8))
    assert plain["spec"] is None and spec["finished"] == plain["finished"] == 8
    assert spec["tpot_s"]["p50"] < 0.5 * plain["tpot_s"]["p50"]
    s = spec["spec"]
    assert s["steps"] > 0 and 0.5 < s["accepted_tokens"] / s["draft_tokens"] < 0.8
    # the draws follow the rate: about 0.8 at the first position
    first = s["per_node"][0]["spec_acceptance_by_position"][0]
    assert first == pytest.approx(0.8, abs=0.07)


def test_acceptance_zero_adaptive_drafts_nothing_fixed_pays() -> None:
    plain = run(None)
    adaptive = run(SpecConfig("adaptive", acceptance=0.0))
    assert adaptive["spec"]["draft_tokens"] == 0
    assert adaptive["tpot_s"] == plain["tpot_s"]
    fixed = run(SpecConfig("fixed", acceptance=0.0))
    assert fixed["spec"]["draft_tokens"] > 0 and fixed["spec"]["accepted_tokens"] == 0
    assert fixed["tpot_s"]["p50"] > plain["tpot_s"]["p50"]  # verify rows cost, none accepted


def test_the_nodes_use_the_daemons_speculator_and_policies() -> None:
    for name, kind in (("adaptive", AdaptivePolicy), ("fixed", FixedPolicy)):
        cfg = ClusterConfig(1, NodeConfig(64 * MB, 0, 32, 2048, spec=SpecConfig(name)))
        node = simulate(table(), [], cfg, progress=False).nodes[0]
        assert isinstance(node.scheduler.speculator, Speculator)
        assert isinstance(node.scheduler.speculator.policy, kind)


def test_a_bad_spec_config_is_refused() -> None:
    with pytest.raises(ValueError, match="acceptance"):
        SpecConfig(acceptance=1.5)
    with pytest.raises(ValueError, match="spec policy"):
        SpecConfig("greedy")


def test_simulate_spec_flags(tmp_path: Path) -> None:
    lines = [
        {"timestamp": 1000 * i, "input_length": 100, "output_length": 60, "hash_ids": [i]}
        for i in range(4)
    ]
    path, out = write_trace(lines, tmp_path), tmp_path / "r.json"
    done = subprocess.run(
        [sys.executable, "-m", "daemon", "simulate", "--trace", str(path), "--out", str(out),
         "--no-progress", "--spec-policy", "fixed", "--spec-k", "3", "--spec-acceptance", "0.9"],
        cwd=ROOT, env=checkout_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    spec = json.loads(out.read_text())["spec"]
    assert spec["accepted_tokens"] > 0.5 * spec["draft_tokens"] > 0
    assert spec["per_node"][0]["spec_policy"] == "FixedPolicy"

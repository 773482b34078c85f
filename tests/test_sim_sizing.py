"""Sizing on a tiny trace: the cluster it picks meets the SLOs, one node fewer does not (run
again here, not read from the search), a run that is sure to miss stops early, and an SLO
nothing meets is said so."""

from __future__ import annotations

import pytest

from daemon.sim.cluster import SLO, ClusterConfig, Simulation
from daemon.sim.node import NodeConfig
from daemon.sim.result import summarize
from daemon.sim.sizing import size, smallest
from daemon.sim.table import Bandwidth
from daemon.sim.trace import read_trace
from tests.sim_traces import conversations, table, write_trace

MB = 2**20
SLOS = SLO(ttft_p99_s=2.0, tpot_p99_s=0.2)
BASE = ClusterConfig(
    1, NodeConfig(16 * MB, 16 * MB, 8, 2048), float("inf"), "least-loaded", 0.01,
    link=Bandwidth(25e9, 1e-4),
)  # fmt: skip


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory):
    lines = conversations(seed=5, sessions=8, turns=3, outputs=6)
    return read_trace(write_trace(lines, tmp_path_factory.mktemp("sizing")))


def meets(trace, unified: int, prefill: int = 0, decode: int = 0) -> bool:
    cfg = ClusterConfig(**(vars(BASE) | {"nodes": unified, "prefill": prefill, "decode": decode}))
    sim = Simulation(table(), trace, cfg)
    sim.run()
    s = summarize(sim.result())
    return (
        s["finished"] == len(trace)
        and s["ttft_s"]["p99"] <= SLOS.ttft_p99_s
        and s["tpot_s"]["p99"] <= SLOS.tpot_p99_s
    )


def test_sizing_picks_the_smallest_cluster_that_meets(trace) -> None:
    result = size(table(), trace, BASE, SLOS, 8, [16 * MB], progress=False)
    unified, pairs = result["best"]["unified"], result["best"]["pairs"]
    assert unified is not None and pairs is not None
    n = unified["unified"]
    assert n > 1  # the load needs more than one node
    assert meets(trace, n) and not meets(trace, n - 1)
    p, d = pairs["prefill"], pairs["decode"]
    assert meets(trace, 0, p, d)
    assert p > 1 and not meets(trace, 0, p - 1, d + 1)  # the same total, fewer prefill nodes
    assert pairs["tpot_p99_s"] < unified["tpot_p99_s"] / 2  # no prefill chunks in its decodes
    assert result["cheapest"]["cost"] == min(n, p + d)
    early = [t for t in result["trials"] if t["stopped_early"]]
    assert early and all(not t["meets"] for t in early)  # the hopeless ones were cut short


def test_an_slo_nothing_meets(trace) -> None:
    result = size(table(), trace, BASE, SLO(1e-4, 1e-4), 3, [0.0], progress=False)
    assert result["best"] == {"unified": None, "pairs": None} and result["cheapest"] is None


def test_smallest_bisects() -> None:
    calls: list[int] = []

    def ok(n: int) -> bool:
        calls.append(n)
        return n >= 37

    assert smallest(1, 100, ok) == 37 and len(calls) <= 8
    assert smallest(1, 10, ok) is None

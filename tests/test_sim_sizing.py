"""Sizing on a tiny trace: the cluster it picks meets the SLOs, one node fewer does not (run
again here, not read from the search), a run that is sure to miss stops early, and an SLO
nothing meets is said so; the prefill / decode split is the cheapest a scan of every split
finds, where the TTFT of a split is not monotone in its prefill count; unified sizing is as
before that search."""

from __future__ import annotations

import argparse
import dataclasses
import json
import random

import pytest

from daemon.sim.cluster import SLO, ClusterConfig, Simulation
from daemon.sim.commands import add_simulate_arguments, run_simulate
from daemon.sim.node import NodeConfig
from daemon.sim.result import summarize
from daemon.sim.sizing import cheapest_split, size, smallest
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


def meets(
    trace, unified: int, prefill: int = 0, decode: int = 0, base: ClusterConfig = BASE
) -> bool:
    cfg = ClusterConfig(**(vars(base) | {"nodes": unified, "prefill": prefill, "decode": decode}))
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


def test_unified_sizing_is_as_before(trace) -> None:
    """The figures the search before `cheapest_split` gave on this trace (main at
    87030c8): the same count, the same runs, the same TTFT / TPOT."""
    result = size(table(), trace, BASE, SLOS, 8, [16 * MB], modes=("unified",), progress=False)
    best = result["best"]["unified"]
    assert best["unified"] == 7
    assert best["ttft_p99_s"] == pytest.approx(1.067823905264957, rel=1e-12)
    assert best["tpot_p99_s"] == pytest.approx(0.16414571128909933, rel=1e-12)
    runs = sorted((t["unified"], t["meets"]) for t in result["trials"])
    assert runs == [(4, False), (6, False), (7, True), (8, True)]


# 4 MB of device KV a node: a decode node holds a few prompts, so one decode node makes
# prompts wait for KV room and the TTFT miss at max_nodes - 1 prefill + 1 decode
SMALL_KV = dataclasses.replace(BASE, node=dataclasses.replace(BASE.node, device_kv_bytes=4 * MB))


def test_pairs_split_is_the_cheapest_of_every_split(trace) -> None:
    max_nodes = 8
    ok = {
        (p, d): meets(trace, 0, p, d, SMALL_KV)
        for p in range(1, max_nodes)
        for d in range(1, max_nodes - p + 1)
    }
    fewest = min(p + d for (p, d), good in ok.items() if good)
    # the search before bisected the prefill count on TTFT from max_nodes - 1 prefill and 1
    # decode down, at each total; that split misses (decode KV waits), so it found nothing
    assert not ok[(max_nodes - 1, 1)] and fewest < max_nodes
    result = size(
        table(), trace, SMALL_KV, SLOS, max_nodes, [16 * MB], modes=("pairs",), progress=False
    )
    pairs = result["best"]["pairs"]
    assert pairs is not None
    p, d = pairs["prefill"], pairs["decode"]
    assert p + d == fewest and ok[(p, d)]
    assert result["pd_ratio"] == pairs["pd_ratio"] and pairs["pd_ratio"].startswith(f"{p}:{d} (1:")
    short = {(t["prefill"], t["decode"]): t["short_of"] for t in result["trials"]}
    assert short.get((max_nodes - 1, 1), "decode") == "decode"
    assert all((s is None) == ok[k] for k, s in short.items() if k in ok)


def test_cheapest_split_bisects_by_the_short_role() -> None:
    """Against a scan of every split, on clusters that meet with at least `need_p` prefill
    and `need_d` decode nodes and `extra` more of either: every split the search probes
    says which role it lacks, as `short_side` does."""
    rng = random.Random(3)
    for _ in range(300):
        max_nodes = rng.randint(2, 30)
        need_p, need_d, extra = rng.randint(1, 12), rng.randint(1, 12), rng.randint(0, 3)
        probes: list[tuple[int, int]] = []

        def probe(p: int, d: int, need_p=need_p, need_d=need_d, extra=extra, probes=probes):
            probes.append((p, d))
            if p >= need_p and d >= need_d and p + d >= need_p + need_d + extra:
                return None
            return "prefill" if p - need_p < d - need_d else "decode"

        fewest = need_p + need_d + extra
        found = cheapest_split(max_nodes, probe)
        if fewest > max_nodes:
            assert found is None
        else:
            assert found is not None and sum(found) == fewest and probe(*found) is None
            assert len(set(probes)) <= 2 + max_nodes.bit_length() ** 2


def test_the_cli_says_the_pd_ratio(trace, tmp_path, capsys) -> None:
    lines = conversations(seed=5, sessions=8, turns=3, outputs=6)
    trace_path = write_trace(lines, tmp_path)
    table().save(tmp_path / "table.json")
    p = argparse.ArgumentParser()
    add_simulate_arguments(p)
    args = p.parse_args(
        [
            "--trace", str(trace_path), "--table", str(tmp_path / "table.json"), "--size",
            "--size-modes", "pairs", "--max-nodes", "8", "--tpot-p99-s", "0.2",
            "--device-kv-gb", str(4 / 1024), "--host-cache-gb", str(16 / 1024),
            "--store-gb", "inf", "--max-num-seqs", "8", "--time-scale", "0.01",
            "--out", str(tmp_path / "size.json"), "--no-progress",
        ]
    )  # fmt: skip
    assert run_simulate(args) == 0
    result = json.loads((tmp_path / "size.json").read_text())
    assert result["pd_ratio"] == "3:3 (1:1.00)"  # the fewest nodes, as the scan above finds
    assert "pairs: 6 nodes, P:D 3:3 (1:1.00), host" in capsys.readouterr().out

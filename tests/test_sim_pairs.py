"""Prefill / decode pairs in the simulator: the daemon's Router picks both nodes, the prefill
node computes the prompt less its last token, the KV crosses the link (bytes from the model's
KV layout), the decode node computes the last token and decodes; the times add up exactly,
a slower link shows, and decode runs taken at once change nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.cluster.router import PrefillBalance, Router
from daemon.sim.cluster import ClusterConfig, Simulation, simulate
from daemon.sim.cost import handoff
from daemon.sim.node import NodeConfig
from daemon.sim.result import summarize
from daemon.sim.table import Bandwidth
from daemon.sim.trace import TraceRequest, read_trace
from tests.sim_traces import BLOCK, conversations, table, write_trace

MB = 2**20
NODE = NodeConfig(16 * MB, 16 * MB, 8, 2048)


def pairs(prefill: int, decode: int, link: Bandwidth, time_scale: float = 0.2) -> ClusterConfig:
    return ClusterConfig(0, NODE, float("inf"), "least-loaded", time_scale, prefill, decode, link)


def test_one_request_times_add_up(tmp_path: Path) -> None:
    n, m = 1000, 5
    line = {"timestamp": 0, "input_length": n, "output_length": m, "hash_ids": [7, 8]}
    trace = read_trace(write_trace([line], tmp_path))
    t = table()
    link = Bandwidth(1e8, 2e-3)
    run = simulate(t, trace, pairs(1, 1, link), progress=False)
    rec = run.records[0]
    assert (rec.prefill_node, rec.node) == (0, 1)
    # 2 layers x 2 heads x 16 dims x float32, K and V: 8 KiB a 16-token block
    kv_bytes = -(-(n - 1) // BLOCK) * 2 * BLOCK * 2 * 16 * 4 * 2
    assert rec.handoff_bytes == kv_bytes
    missed = t.store_read.seconds(1)  # the prefill node looked in the store first: a miss
    prefilled = missed + t.prefill.at(n - 1, 0)  # one chunk: the prompt less its last token
    # the export read out in the prefill node's next run (alone), the link, the import in the
    # decode node's next run (alone): each at the table's host-copy bandwidth
    export = t.host_save.seconds(kv_bytes)
    imported = t.host_load.seconds(kv_bytes)
    assert export > 0 and imported > 0
    # the export's run also copies the prompt's full blocks out for the store, as the engine
    # runs a step's cache ops with its transfers
    export += t.host_save.seconds((n - 1) // BLOCK * t.kv.bytes_per_block)
    want = prefilled + export + 2e-3 + kv_bytes / 1e8 + imported
    assert rec.handoff_s == pytest.approx(want, rel=1e-12)
    first = rec.handoff_s + t.decode.at(1, n - 1)  # the last prompt token, sampled
    assert rec.first_token_s == pytest.approx(first, rel=1e-12)
    decode = run.nodes[1].counters
    assert decode.prefill_tokens == 0 and decode.decode_tokens == m
    assert run.nodes[0].counters.prefill_tokens == n - 1
    assert run.nodes[0].counters.decode_tokens == 0


def test_the_router_picks_by_prefix_then_load(tmp_path: Path) -> None:
    lines = conversations(seed=1, sessions=6, turns=3, outputs=4)
    trace = read_trace(write_trace(lines, tmp_path))
    sim = Simulation(table(), trace, pairs(2, 2, Bandwidth(25e9, 1e-4)))
    assert type(sim.pairs.router) is Router  # the daemon's own
    sim.run()
    run = sim.result()
    summary = summarize(run)
    assert summary["finished"] == len(lines) and summary["handoff"]["count"] == len(lines)
    # a later turn goes where the router sent its earlier turns' blocks
    by_first: dict[int, set[int]] = {}
    for line, rec in zip(lines, run.records):
        by_first.setdefault(line["hash_ids"][0], set()).add(rec.prefill_node)
    assert all(len(nodes) == 1 for nodes in by_first.values())
    assert {rec.prefill_node for rec in run.records} == {0, 1}  # both used (load breaks ties)
    assert {rec.node for rec in run.records} == {2, 3}
    roles = [n["role"] for n in summary["per_node"]]
    assert roles == ["prefill", "prefill", "decode", "decode"]
    assert summary["timeline"][0]["roles"] == {"prefill": 2, "decode": 2}
    assert summary["prefix"]["hit_rate"] > 0.2  # the prefill nodes' caches served the turns


def test_a_slow_link_shows_in_ttft(tmp_path: Path) -> None:
    trace = read_trace(write_trace(conversations(seed=2, sessions=4, turns=2), tmp_path))
    ttft = {}
    for gb_s in (0.05, 50.0):
        run = simulate(table(), trace, pairs(1, 1, Bandwidth(gb_s * 1e9)), progress=False)
        ttft[gb_s] = summarize(run)["ttft_s"]["p50"]
    assert ttft[0.05] > ttft[50.0] + 0.01  # ~200 KB a request at 50 MB/s: 4 ms and more


@pytest.mark.parametrize("kv_mb", [16, 1.5], ids=["roomy", "decode-short-of-kv"])
def test_pairs_decode_runs_change_nothing(kv_mb: float, tmp_path: Path) -> None:
    trace = read_trace(write_trace(conversations(seed=4, sessions=10, outputs=30), tmp_path))
    cfg = pairs(1, 2, Bandwidth(5e9, 1e-3), time_scale=0.1)
    cfg.node = NodeConfig(kv_mb * MB, 4 * MB, 6, 512)
    out = []
    for step_by_step in (False, True):
        s = summarize(simulate(table(), trace, cfg, progress=False, step_by_step=step_by_step))
        s.pop("wall_s")
        out.append(s)
    assert out[0] == out[1]
    assert out[0]["finished"] > 0 and out[0]["handoff"]["count"] == out[0]["finished"]


def test_a_prefill_node_sends_one_handoff_at_a_time(tmp_path: Path) -> None:
    lines = [
        {"timestamp": 0, "input_length": 300, "output_length": 2, "hash_ids": [i]} for i in (1, 2)
    ]
    trace = read_trace(write_trace(lines, tmp_path))
    link = Bandwidth(1e8, 0.05)
    run = simulate(table(), trace, pairs(1, 1, link), progress=False)
    done = sorted(r.handoff_s for r in run.records)  # type: ignore[type-var]
    one = link.seconds(-(-299 // BLOCK) * 2 * BLOCK * 2 * 16 * 4 * 2)
    # the second prompt is computed before the first one's KV is through: it waits its turn
    assert done[1] == pytest.approx(done[0] + one)


def test_an_export_is_read_with_the_prefill_nodes_next_step() -> None:
    """As the engine does (Engine._prefilled queues the export; the transfer settles when the
    run that carried it is back): a prompt prefilled while another waits is sent only after
    that other prompt's step, which its export rides with."""
    t = table()
    a, b = t.prefill.at(999, 0), t.prefill.at(1499, 0)
    trace = [TraceRequest(0.0, 1000, 3, (1, 2)), TraceRequest(a / 2, 1500, 3, (3, 4, 5))]
    link = Bandwidth(1e9, 1e-3)
    cfg = ClusterConfig(0, NODE, 0.0, prefill=1, decode=1, link=link)
    run = simulate(t, trace, cfg, progress=False)
    first = run.records[0]
    nbytes, export, imported = handoff(t, 999)
    assert first.handoff_bytes == nbytes
    # its step, then b's step with its export, the link, the import (the decode node idle)
    want = a + b + export + link.seconds(nbytes) + imported
    assert first.handoff_s == pytest.approx(want, rel=1e-12)


def test_an_import_waits_for_the_decode_nodes_running_step() -> None:
    """The KV reaching a decode node mid-step is imported with its next run: the request is
    admitted a whole decode step (and the rest of the running one) after the KV came."""
    t = table()
    long = TraceRequest(0.0, 40, 400, (1,))  # decodes for seconds on the decode node
    trace = [long, TraceRequest(0.5, 1000, 3, (2, 3))]
    link = Bandwidth(1e9, 1e-3)
    cfg = ClusterConfig(0, NODE, 0.0, prefill=1, decode=1, link=link)
    run = simulate(t, trace, cfg, progress=False)
    rec = run.records[1]
    nbytes, export, _ = handoff(t, 999)
    came = 0.5 + t.prefill.at(999, 0) + export + link.seconds(nbytes)  # the prefill node idle
    assert run.records[0].finish_s > came + 1.0  # type: ignore[operator]
    one_step = t.decode.at(1, 40)
    assert rec.handoff_s > came + one_step  # type: ignore[operator]
    assert rec.handoff_s < came + 3 * t.decode.at(1, 440)  # type: ignore[operator]


@pytest.mark.parametrize(
    ("balance", "split"),
    [(PrefillBalance(1.0, 0), True), (PrefillBalance(100.0, 100), False)],
    ids=["load-first", "prefix-first"],
)
def test_the_prefill_balance_reaches_the_router(balance: PrefillBalance, split: bool) -> None:
    """`--prefill-balance-rel / -abs`: the daemon's Router gets them. Every prompt shares its
    first block (a system prompt): a strict bound spreads the prefills over both nodes, a loose
    one sends them all to the node that was sent the prefix first."""
    trace = [TraceRequest(0.0, 700, 2, (0, 10 + i)) for i in range(8)]
    cfg = ClusterConfig(0, NODE, 0.0, prefill=2, decode=1, balance=balance)
    sim = Simulation(table(), trace, cfg)
    assert sim.pairs.router.balance is balance
    sim.run()
    used = {r.prefill_node for r in sim.result().records}
    assert used == ({0, 1} if split else {0})

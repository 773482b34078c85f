"""The simulator's P/D cluster under the router's autoscaling policy (the same module): a
traffic shift (prefill-heavy, decode-heavy, prefill-heavy) moves nodes after their drain, each
decision is in the result with its inputs, and SLO attainment beats fixed roles."""

from __future__ import annotations

import itertools

import orjson
import pytest

from daemon.cluster.autoscale import Targets
from daemon.sim.node import NodeConfig
from daemon.sim.pd import PDConfig, simulate_pd, summarize_pd
from daemon.sim.table import Bandwidth, CostTable, Grid, KVGeometry, Provenance
from daemon.sim.trace import TraceRequest

TARGETS = Targets(ttft_p99_s=3.0, tpot_p99_s=0.06, node_dwell_s=10, global_dwell_s=5)
NODE = NodeConfig(64 * 2**20, 0, 64, 2048)
PHASE_S = 20


def table() -> CostTable:
    """A 2048-token prefill takes a second; a decode step of 64 takes 0.2 s."""
    return CostTable(
        Provenance("test", "2026-12-02T00:00:00+00:00", "cpu", "made by hand", "float32"),
        KVGeometry(16, 2, 2, 16, "float32"),
        Grid([16, 2048], [0, 8192], [[0.01, 0.02], [1.0, 1.2]]),
        Grid([1, 64], [16, 8192], [[0.01, 0.02], [0.2, 0.3]]),
        Bandwidth(1e10),
        Bandwidth(1e10),
        Bandwidth(1e9, 1e-3),
        Bandwidth(1e9, 1e-3),
    )


def shift() -> list[TraceRequest]:
    ids = itertools.count()

    def phase(start: float, rate: float, prompt: int, output: int) -> list[TraceRequest]:
        n = int(PHASE_S * rate)
        blocks = -(-prompt // 512)
        return [
            TraceRequest(start + i / rate, prompt, output, tuple(next(ids) for _ in range(blocks)))
            for i in range(n)
        ]

    return phase(0, 3, 2048, 2) + phase(PHASE_S, 5, 64, 100) + phase(2 * PHASE_S, 3, 2048, 2)


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    trace = shift()
    out = {}
    for name, targets in (("fixed", None), ("autoscaled", TARGETS)):
        run = simulate_pd(table(), trace, PDConfig(2, 2, NODE, targets=targets, window_s=5))
        out[name] = summarize_pd(run, TARGETS)
    return out


def test_the_shift_moves_nodes_after_their_drain(runs: dict[str, dict]) -> None:
    result = runs["autoscaled"]
    assert result["finished"] == result["requests"] == 220
    moves = result["moves"]
    # prefill-heavy: a decode node goes prefill; decode-heavy: back; then prefill again
    assert [m["role"] for m in moves] == ["prefill", "decode", "prefill"]
    assert moves[0]["decided_s"] < PHASE_S <= moves[1]["decided_s"] < 2 * PHASE_S
    assert all(m["switched_s"] >= m["decided_s"] for m in moves)
    assert moves[1]["switched_s"] > moves[1]["decided_s"]  # it drained its prefills first
    moved = [d for d in result["decisions"] if d["kind"] != "hold"]
    assert [d["kind"] for d in moved] == [
        "decode_to_prefill",
        "prefill_to_decode",
        "decode_to_prefill",
    ]
    first = moved[0]
    assert first["prefill_pressure"] > TARGETS.up > TARGETS.down > first["decode_pressure"]
    assert first["inputs"]["ttft_p99_s"] > TARGETS.ttft_p99_s
    assert {n["role"] for n in first["inputs"]["nodes"]} == {"prefill", "decode"}
    assert any("minimum" in d["reason"] for d in result["decisions"])
    orjson.dumps(result)  # the result JSON holds every decision with its inputs


def test_autoscaling_beats_fixed_roles(runs: dict[str, dict]) -> None:
    fixed, scaled = runs["fixed"], runs["autoscaled"]
    assert fixed["decisions"] == [] and fixed["moves"] == []
    assert scaled["slo"]["attainment"] > fixed["slo"]["attainment"]
    assert scaled["node_seconds"]["prefill"] > scaled["node_seconds"]["decode"]
    assert fixed["node_seconds"]["prefill"] == pytest.approx(fixed["node_seconds"]["decode"])


def test_a_cluster_without_a_role_is_refused() -> None:
    with pytest.raises(ValueError, match="prefill and a decode"):
        simulate_pd(table(), shift(), PDConfig(0, 2, NODE))


def test_short_prompts_are_computed_on_their_decode_node() -> None:
    short = [TraceRequest(i * 0.1, 16, 8, (i,)) for i in range(20)]
    cfg = PDConfig(1, 1, NODE, handoff_min_tokens=64)
    run = simulate_pd(table(), short + [TraceRequest(2.5, 2048, 2, (99, 100, 101, 102))], cfg)
    assert [r.prefill_node for r in run.records] == [-1] * 20 + [0]
    assert all(r.decode_node == 1 and r.finish_s is not None for r in run.records)


def test_each_leg_waits_for_its_nodes_front() -> None:
    # three prompts at once on one prefill node: each leg takes the front's 0.5 s in turn, on
    # the prefill node and again on the decode node
    burst = [TraceRequest(0.0, 2048, 2, (3 * i, 3 * i + 1, 3 * i + 2)) for i in range(3)]
    plain = simulate_pd(table(), burst, PDConfig(1, 1, NODE)).records
    fronted = simulate_pd(table(), burst, PDConfig(1, 1, NODE, request_s=0.5)).records
    for a, b in zip(plain, fronted):
        assert a.first_token_s is not None and b.first_token_s is not None
        assert b.first_token_s - a.first_token_s >= 0.5 - 1e-9
    # the third prompt's prefill leg reached its scheduler only after 3 x 0.5 s
    assert fronted[2].first_token_s >= 1.5 + 1.0


def test_the_front_per_token_is_paid_by_the_leg_that_takes_the_request_in() -> None:
    one = [TraceRequest(0.0, 2048, 2, (0, 1, 2, 3))]
    plain = simulate_pd(table(), one, PDConfig(1, 1, NODE)).records[0]
    paid = simulate_pd(table(), one, PDConfig(1, 1, NODE, request_s_per_token=0.001)).records[0]
    assert plain.first_token_s is not None and paid.first_token_s is not None
    # 2.048 s on the prefill node; the decode leg (a handoff) pays none
    assert paid.first_token_s - plain.first_token_s == pytest.approx(2.048, abs=0.05)


def test_a_decode_node_pays_for_each_token_it_streams() -> None:
    # one request, 64 output tokens: each step's token is streamed with the next run, so the
    # request ends ~63 x 10 ms later (its last token's stream is not waited for)
    one = [TraceRequest(0.0, 16, 64, (0,))]
    cfg = PDConfig(1, 1, NODE, handoff_min_tokens=64)
    plain = simulate_pd(table(), one, cfg).records[0]
    cfg.stream_s_per_token = 0.01
    paid = simulate_pd(table(), one, cfg).records[0]
    assert plain.finish_s is not None and paid.finish_s is not None
    assert paid.finish_s - plain.finish_s == pytest.approx(0.63, abs=0.02)
    assert paid.first_token_s == pytest.approx(plain.first_token_s)

"""The clients' concurrency bound in the simulator (`--max-concurrency`, as `deepinfer bench
serve`'s): never more requests in flight, each held request sent the moment one finishes, and
decode runs taken at once change nothing, unified and in pairs."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.sim.cluster import ClusterConfig, simulate
from daemon.sim.cost import handoff
from daemon.sim.node import NodeConfig
from daemon.sim.result import summarize
from daemon.sim.trace import TraceRequest
from tests.sim_traces import table

MB = 2**20
NODE = NodeConfig(16 * MB, 0, 8, 2048)


def burst(n: int = 12) -> list[TraceRequest]:
    """`n` requests at once, prompts of their own blocks, outputs of different lengths."""
    return [TraceRequest(0.0, 100 + 37 * i, 5 + 3 * (i % 4), (1000 * i,)) for i in range(n)]


def config(bound: int, pairs: bool = False) -> ClusterConfig:
    nodes, prefill, decode = (0, 1, 1) if pairs else (1, 0, 0)
    return ClusterConfig(nodes, NODE, 0.0, prefill=prefill, decode=decode, max_concurrency=bound)


@pytest.mark.parametrize("pairs", [False, True], ids=["unified", "pair"])
def test_at_most_the_bound_in_flight_and_each_sent_as_one_finishes(pairs: bool) -> None:
    run = simulate(table(), burst(), config(3, pairs), progress=False)
    recs = sorted(run.records, key=lambda r: r.arrival_s)
    assert all(r.finish_s is not None for r in recs)
    finishes = sorted(r.finish_s for r in recs)  # type: ignore[type-var]
    assert [r.arrival_s for r in recs[:3]] == [0.0] * 3
    # the k-th held request is sent when the k-th request finishes
    assert [r.arrival_s for r in recs[3:]] == finishes[: len(recs) - 3]
    for r in recs:  # never more than 3 in flight
        assert sum(o.arrival_s <= r.arrival_s < o.finish_s for o in recs) <= 3  # type: ignore[operator]


def test_no_bound_sends_everything_at_its_arrival() -> None:
    run = simulate(table(), burst(), config(0), progress=False)
    assert {r.arrival_s for r in run.records} == {0.0}
    bounded = summarize(simulate(table(), burst(), config(3), progress=False))
    free = summarize(run)
    assert bounded["ttft_s"]["p50"] < free["ttft_s"]["p50"]  # fewer prompts queue at once
    assert bounded["simulated_s"] > free["simulated_s"]  # smaller batches: longer in all


@pytest.mark.parametrize("pairs", [False, True], ids=["unified", "pair"])
def test_decode_runs_with_a_bound_change_nothing(pairs: bool, tmp_path: Path) -> None:
    out = []
    for step_by_step in (False, True):
        run = simulate(table(), burst(16), config(4, pairs), False, step_by_step=step_by_step)
        summary = summarize(run)
        summary.pop("wall_s")
        out.append((summary, run.events))
    (fast, events), (slow, slow_events) = out
    assert fast == slow
    assert events < slow_events


@pytest.mark.parametrize("pairs", [False, True], ids=["unified", "pair"])
def test_the_http_front_takes_requests_one_at_a_time(pairs: bool) -> None:
    """Three requests sent at once reach the serving node's scheduler 50 ms apart: the first
    computes alone (the others arrive during its step), as a daemon's event loop parses them."""
    t = table()
    trace = [TraceRequest(0.0, 500, 3, (i,)) for i in range(3)]  # one 512-token block each
    cfg = config(0, pairs)
    cfg.request_s = 0.05
    run = simulate(t, trace, cfg, progress=False)
    first = min(run.records, key=lambda r: r.first_token_s)  # type: ignore[arg-type,return-value]
    if pairs:  # the decode node has it at 50 ms, then the prefill node computes it alone
        nbytes, export, imported = handoff(t, 499)
        assert t.prefill.at(499, 0) > 0.05  # the second prompt is there by its end
        # its export goes with the second prompt's step; the decode node imports it alone
        steps = 2 * t.prefill.at(499, 0) + export
        want = 0.05 + steps + cfg.link.seconds(nbytes) + imported
        assert first.handoff_s == pytest.approx(want)
    else:
        assert first.first_token_s == pytest.approx(0.05 + t.prefill.at(500, 0))
    later = [r for r in run.records if r is not first]
    assert all(r.first_token_s > first.first_token_s + 0.04 for r in later)  # type: ignore[operator]
    assert {r.arrival_s for r in run.records} == {0.0}  # TTFT counts from the client's send


def test_overlap_schedules_the_next_step_while_one_runs() -> None:
    """Under overlap a node schedules step B as soon as it launches A, so a request arriving
    during A is computed in the step after B, as the engine's 3-stage loop does; every request
    still gets exactly its tokens."""
    t = table()
    prefill_a = t.prefill.at(400, 0)
    trace = [
        TraceRequest(0.0, 400, 6, (1,)),
        TraceRequest(prefill_a / 2, 300, 4, (2,)),  # arrives during the first step
    ]
    first: dict[bool, float] = {}
    for overlap in (False, True):
        cfg = config(0)
        cfg.overlap = overlap
        run = simulate(t, trace, cfg, progress=False)
        late = run.records[1]
        assert run.records[0].first_token_s == pytest.approx(prefill_a)
        first[overlap] = late.first_token_s  # type: ignore[assignment]
        assert run.nodes[0].counters.decode_tokens == 6 + 4 - 2  # the rest are prefills' samples
        if overlap:  # A, then B (request 0's decode, queued at 0), then C with request 1
            chunk = t.prefill.at(300, 0)
            mixed = t.decode.at(1, 401) + max(chunk - t.decode.at(1, 16), 0.1 * chunk)
            assert late.first_token_s == pytest.approx(prefill_a + t.decode.at(1, 400) + mixed)
    assert first[True] > first[False]

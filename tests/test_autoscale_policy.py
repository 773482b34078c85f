"""The P:D autoscaling policy: pressures, hysteresis, dwell times, minimums; the router's
inputs to it: the SLO window, a stream's TTFT / TPOT, a window read from the heartbeats."""

from __future__ import annotations

import pytest

from daemon.cluster.autoscale import Autoscaler, NodeLoad, Targets, WindowInputs, pressures
from daemon.cluster.autoscale_inputs import window_inputs
from daemon.cluster.node import NodeInfo
from daemon.cluster.peers import PeerSet
from daemon.cluster.slo_window import SloWindow, p99
from daemon.cluster.stream_timing import StreamTiming, carries_output

T = Targets(ttft_p99_s=1.0, tpot_p99_s=0.1, up=1.0, down=0.6, node_dwell_s=60, global_dwell_s=20)


def nodes(prefill: int = 2, decode: int = 2, busy: dict[str, int] | None = None):
    busy = busy or {}
    out = [NodeLoad(f"p{i}", "prefill", running=busy.get(f"p{i}", 0)) for i in range(prefill)]
    return tuple(out + [NodeLoad(f"d{i}", "decode", busy.get(f"d{i}", 0)) for i in range(decode)])


def window(now=0.0, ttft=None, tpot=None, kv=None, pq=0, dq=0, ns=None) -> WindowInputs:
    return WindowInputs(now, ttft, tpot, kv, pq, dq, ns if ns is not None else nodes(), 10)


def test_decode_pressure_moves_the_least_busy_prefill_node():
    a = Autoscaler(T)
    d = a.decide(window(ttft=0.3, tpot=0.2, ns=nodes(busy={"p0": 3, "p1": 1})))
    assert (d.kind, d.node_id) == ("prefill_to_decode", "p1")
    assert d.inputs.tpot_p99_s == 0.2 and d.decode_pressure == pytest.approx(2.0)
    assert d.to_json()["inputs"]["nodes"][0]["node_id"] == "p0"


def test_kv_utilisation_and_queues_count_as_decode_and_prefill_pressure():
    a = Autoscaler(T)
    assert a.decide(window(kv=0.95)).kind == "prefill_to_decode"
    assert a.decide(window(pq=40)).kind == "decode_to_prefill"  # 20 a node, target 8
    assert pressures(window(kv=0.425), T) == (0.0, pytest.approx(0.5))


def test_hysteresis_band_holds():
    a = Autoscaler(T)
    # decode over target but prefill not below `down`: no headroom counted yet
    assert a.decide(window(ttft=0.8, tpot=0.2)).kind == "hold"
    assert a.decide(window(ttft=0.5, tpot=0.2)).kind == "prefill_to_decode"
    # between down and up on both sides: nothing moves either way
    d = a.decide(window(ttft=0.9, tpot=0.09))
    assert d.kind == "hold" and "hysteresis" in d.reason
    assert a.decide(window(ttft=2.0, tpot=0.3, pq=40)).reason.startswith("both sides")


def test_global_dwell_then_node_dwell():
    a = Autoscaler(T)
    first = a.decide(window(now=0, ttft=0.1, tpot=0.5, ns=nodes(prefill=3)))
    assert first.node_id == "p0"
    a.moved(first, 0)
    moved = (NodeLoad("p1", "prefill"), NodeLoad("p2", "prefill"), NodeLoad("p0", "decode"))
    moved += (NodeLoad("d0", "decode"),)
    assert "global dwell" in a.decide(window(now=10, tpot=0.5, ns=moved)).reason
    # p0 is back in demand as prefill at 30 s: past the global dwell, not its own
    back = a.decide(window(now=30, ttft=3.0, ns=moved))
    assert back.kind == "decode_to_prefill" and back.node_id == "d0"
    only_p0 = (NodeLoad("p1", "prefill"), NodeLoad("p0", "decode"), NodeLoad("d9", "decode"))
    a.moved_at["d9"] = 25
    held = a.decide(window(now=30, ttft=3.0, ns=only_p0))
    assert held.kind == "hold" and "node dwell" in held.reason
    assert a.decide(window(now=61, ttft=3.0, ns=only_p0)).node_id == "p0"


def test_a_decision_not_carried_out_starts_no_dwell():
    a = Autoscaler(T)
    assert a.decide(window(now=0, tpot=0.5)).kind == "prefill_to_decode"
    assert a.decide(window(now=1, tpot=0.5)).kind == "prefill_to_decode"


def test_the_last_node_of_a_role_stays():
    a = Autoscaler(T)
    d = a.decide(window(tpot=0.5, ns=nodes(prefill=1)))
    assert d.kind == "hold" and "minimum" in d.reason
    assert a.decide(window(ttft=5.0, ns=nodes(decode=1))).kind == "hold"


def test_no_samples_no_pressure():
    assert Autoscaler(T).decide(window()).kind == "hold"


def test_targets_are_checked():
    with pytest.raises(ValueError, match="down < up"):
        Targets(up=0.5, down=0.6)
    with pytest.raises(ValueError, match="min_per_role"):
        Targets(min_per_role=0)


def test_slo_window_keeps_one_window():
    w = SloWindow(10)
    for i in range(100):
        w.add(float(i) / 10, ttft_s=i / 100, tpot_s=None if i % 2 else 0.01 * i)
    ttft, tpot, n = w.read(10.0)
    assert n == 100 and ttft == 0.98 and tpot == pytest.approx(0.98)
    assert w.read(25.0) == (None, None, 0)
    assert p99([3.0]) == 3.0 and p99([]) is None


def test_stream_timing_counts_output_events_only():
    chat = StreamTiming("/v1/chat/completions", started=0.0)
    chat.feed(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n', 0.1)
    assert chat.ttft_s() is None  # the opening carries no output
    chat.feed(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n', 0.5)
    chat.feed(b'data: {"choices":[{"delta":{"content":"b"}}]}\n\n', 0.7)
    chat.feed(b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n', 0.8)
    assert chat.ttft_s() == 0.5 and chat.tpot_s() == pytest.approx(0.2)
    msg = StreamTiming("/v1/messages", started=1.0)
    msg.feed(b"event: message_start\ndata: {}\n\n", 1.1)
    msg.feed(b"event: content_block_delta\ndata: {}\n\n", 1.4)
    assert msg.ttft_s() == pytest.approx(0.4) and msg.tpot_s() is None
    assert carries_output("/v1/responses", b"event: response.output_text.delta\ndata: {}")
    assert not carries_output("/v1/responses", b"event: response.created\ndata: {}")
    assert carries_output("/v1/completions", b'data: {"choices":[{"text":"x"}]}')


def test_window_inputs_from_heartbeats():
    peers, slo = PeerSet(clock=lambda: 0.0), SloWindow(10)
    info = dict(fingerprint="f", url="http://h:1", epoch=1, served_model="m")
    peers.upsert(NodeInfo("p0", "prefill", **info, load={"waiting": 3, "running": 2}), 5)
    peers.upsert(NodeInfo("d0", "decode", **info, capacity={"kv_blocks": 100},
                          load={"kv_blocks_free": 25, "waiting": 1, "running": 4}), 5)  # fmt: skip
    peers.upsert(NodeInfo("d1", "decode", **info, capacity={"kv_blocks": 100},
                          load={"kv_blocks_free": 0, "draining": 1}), 5)  # fmt: skip
    slo.add(0.0, 1.5, 0.05)
    w = window_inputs(peers, slo, 1.0)
    assert (w.ttft_p99_s, w.tpot_p99_s, w.samples) == (1.5, 0.05, 1)
    assert w.decode_kv_util == 0.75  # the draining node is left out
    # a prefill node's running prompts are queued too (none has its first token); a decode
    # node's running requests are streaming
    assert (w.prefill_queue, w.decode_queue, w.count("decode")) == (5, 1, 1)
    assert w.nodes[1] == NodeLoad("d0", "decode", running=4, waiting=1)


def test_when_both_sides_are_late_an_idle_prefill_queue_gives_a_node_to_decode():
    # a full decode node: its queued requests are late to their first token too, so TTFT is
    # over target as well as the decode side; the prefill nodes hold no queue
    a = Autoscaler(T)
    d = a.decide(window(ttft=4.0, tpot=0.05, dq=20, ns=nodes(prefill=3, decode=1)))
    assert (d.kind, d.node_id) == ("prefill_to_decode", "p0")
    assert d.prefill_pressure > T.up and d.decode_pressure > T.up
    assert a.decide(window(ttft=4.0, kv=0.95, ns=nodes(prefill=3, decode=1))).kind == (
        "prefill_to_decode"
    )
    # prefill queued as well, even a little: both are short, nothing moves (above all not
    # the decode side's KV-full node away: its TTFT is not the prefill side's to claim)
    assert a.decide(window(ttft=4.0, kv=0.95, pq=40)).reason.startswith("both sides")
    few = window(ttft=16.0, kv=0.98, pq=4, ns=nodes(prefill=3, decode=1))
    assert a.decide(few).reason.startswith("both sides")
    assert a.decide(window(ttft=4.0, tpot=0.3, pq=40, dq=40)).reason.startswith("both sides")


def test_when_both_sides_are_late_a_decode_backlog_beside_a_short_prefill_queue_gives_a_node():
    # after a shift to short prompts and long outputs the window's TTFTs are still the prefill
    # backlog's; the queues say where the requests wait now (measured: 1 prefill and 81
    # decode requests waiting on 3 + 1 nodes while both pressures were over 4)
    a = Autoscaler(T)
    late = window(ttft=24.0, tpot=0.1, pq=1, dq=81, ns=nodes(prefill=3, decode=1))
    assert a.decide(late).kind == "prefill_to_decode"
    # 8 waiting over 3 prefill nodes is 0.33 of the target a node, under `down`
    assert a.decide(window(ttft=15.0, tpot=0.4, pq=8, dq=33, ns=nodes(3, 1))).node_id == "p0"
    # the decode queue under target (8 a node) or the prefill one not under `down`: both short
    assert a.decide(window(ttft=15.0, tpot=0.4, pq=1, dq=7, ns=nodes(3, 1))).kind == "hold"
    assert a.decide(window(ttft=15.0, tpot=0.4, pq=15, dq=81, ns=nodes(3, 1))).kind == "hold"

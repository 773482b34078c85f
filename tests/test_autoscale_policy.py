"""The P:D autoscaling policy: pressures, hysteresis, dwell times, minimums; and the SLO window."""

from __future__ import annotations

import pytest

from daemon.cluster.autoscale import Autoscaler, NodeLoad, Targets, WindowInputs, pressures
from daemon.cluster.slo_window import SloWindow, p99

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
    assert a.decide(window(ttft=2.0, tpot=0.3)).reason.startswith("both sides")


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

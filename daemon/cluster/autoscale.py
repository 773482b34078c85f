"""The P:D autoscaling policy, pure (no I/O, no clock of its own): one window's inputs in, one
decision out (move a node prefill -> decode, decode -> prefill, or hold). The router and the
simulator run this same code."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Kind = Literal["prefill_to_decode", "decode_to_prefill", "hold"]
KINDS: tuple[Kind, ...] = ("prefill_to_decode", "decode_to_prefill", "hold")


@dataclass(frozen=True)
class Targets:
    """SLO targets and the controller's constants. A pressure is measured / target: above `up`
    a side needs a node, below `down` it can give one (up > down: the hysteresis band)."""

    ttft_p99_s: float = 2.0
    tpot_p99_s: float = 0.1
    kv_util: float = 0.85  # decode KV utilisation counted as full pressure
    queue_per_node: float = 8.0  # waiting requests per node counted as full pressure
    up: float = 1.0
    down: float = 0.6
    node_dwell_s: float = 60.0  # a node that moved stays in its role at least this long
    global_dwell_s: float = 20.0  # and no node moves within this of the last move
    min_per_role: int = 1

    def __post_init__(self) -> None:
        if not 0 < self.down < self.up:
            raise ValueError("the thresholds need 0 < down < up")
        for name in ("ttft_p99_s", "tpot_p99_s", "kv_util", "queue_per_node"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.node_dwell_s < 0 or self.global_dwell_s < 0:
            raise ValueError("dwell times must be non-negative")
        if self.min_per_role < 1:
            raise ValueError("min_per_role must be at least 1")


@dataclass(frozen=True)
class NodeLoad:
    node_id: str
    role: Literal["prefill", "decode"]
    running: int = 0
    waiting: int = 0


@dataclass(frozen=True)
class WindowInputs:
    """What one window showed. None: no sample in the window (that signal adds no pressure)."""

    now: float  # seconds on the caller's clock (monotonic in the router, simulated in the sim)
    ttft_p99_s: float | None
    tpot_p99_s: float | None
    decode_kv_util: float | None  # used / total KV blocks over the decode nodes
    prefill_queue: int  # `queued` over the prefill nodes
    decode_queue: int
    nodes: tuple[NodeLoad, ...]
    samples: int = 0  # requests measured in the window

    def count(self, role: str) -> int:
        return sum(n.role == role for n in self.nodes)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Decision:
    kind: Kind
    node_id: str | None  # the node to move (None: hold)
    reason: str
    prefill_pressure: float
    decode_pressure: float
    inputs: WindowInputs = field(repr=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "node_id": self.node_id,
            "reason": self.reason,
            "prefill_pressure": self.prefill_pressure,
            "decode_pressure": self.decode_pressure,
            "inputs": self.inputs.to_json(),
        }


def queued(nodes: Iterable[NodeLoad], role: Literal["prefill", "decode"]) -> int:
    """A side's queue: the requests it holds that it has not served. On a prefill node that is
    every one (its running prompts share its steps, chunk by chunk: none has its first token
    yet), on a decode node the waiting ones (a running one is streaming)."""
    return sum(n.waiting + (n.running if role == "prefill" else 0) for n in nodes if n.role == role)


def queue_pressures(inputs: WindowInputs, t: Targets) -> tuple[float, float]:
    """(prefill, decode): `queued` requests per node against `queue_per_node`."""
    n_prefill, n_decode = max(inputs.count("prefill"), 1), max(inputs.count("decode"), 1)
    return (
        inputs.prefill_queue / n_prefill / t.queue_per_node,
        inputs.decode_queue / n_decode / t.queue_per_node,
    )


def pressures(inputs: WindowInputs, t: Targets) -> tuple[float, float]:
    """(prefill, decode): the worst of each side's signals against its target."""
    queued_prefill, queued_decode = queue_pressures(inputs, t)
    prefill = max((inputs.ttft_p99_s or 0.0) / t.ttft_p99_s, queued_prefill)
    decode = max(
        (inputs.tpot_p99_s or 0.0) / t.tpot_p99_s,
        (inputs.decode_kv_util or 0.0) / t.kv_util,
        queued_decode,
    )
    return prefill, decode


class Autoscaler:
    """Decides on each window; `moved` records a move that was carried out (the dwell times
    run from then). A decision is only a proposal until its caller reports it moved."""

    def __init__(self, targets: Targets) -> None:
        self.targets = targets
        self.last_move: float | None = None
        self.moved_at: dict[str, float] = {}

    def decide(self, inputs: WindowInputs) -> Decision:
        t = self.targets
        prefill, decode = pressures(inputs, t)

        def hold(reason: str) -> Decision:
            return Decision("hold", None, reason, prefill, decode, inputs)

        if decode > t.up and prefill < t.down:
            kind: Kind = "prefill_to_decode"
        elif prefill > t.up and decode < t.down:
            kind = "decode_to_prefill"
        elif prefill > t.up and decode > t.up:
            # a TTFT counts the wait for a decode slot or KV too (a request waiting on a full
            # decode node is late on both sides), and it lags: a window's TTFTs are of requests
            # that waited through the last ones. The queues are each side's own, and now. So
            # the decode side is the one short with nothing queued on the prefill nodes, or
            # with its own queue over target and the prefill one under `down`. (A few queued
            # on the prefill side and none on the decode side: both are short; a measured run
            # flapped when that counted as the decode side's.)
            queued_prefill, queued_decode = queue_pressures(inputs, t)
            if inputs.prefill_queue == 0 or (queued_decode > t.up and queued_prefill < t.down):
                kind = "prefill_to_decode"
            else:
                return hold("both sides over target: no headroom to move")
        else:
            return hold("within the hysteresis band")
        source = "prefill" if kind == "prefill_to_decode" else "decode"
        if inputs.count(source) <= t.min_per_role:
            return hold(f"{source} is at its minimum of {t.min_per_role}")
        if self.last_move is not None and inputs.now - self.last_move < t.global_dwell_s:
            return hold("global dwell: the last move is too recent")
        ready = [
            n
            for n in inputs.nodes
            if n.role == source
            and (
                n.node_id not in self.moved_at
                or inputs.now - self.moved_at[n.node_id] >= t.node_dwell_s
            )
        ]
        if not ready:
            return hold(f"node dwell: every {source} node moved too recently")
        # the one with the least to drain
        node = min(ready, key=lambda n: (n.running + n.waiting, n.node_id))
        why = f"{'decode' if source == 'prefill' else 'prefill'} over target, {source} has headroom"
        return Decision(kind, node.node_id, why, prefill, decode, inputs)

    def moved(self, decision: Decision, now: float) -> None:
        if decision.node_id is None:
            return
        self.last_move = now
        self.moved_at[decision.node_id] = now

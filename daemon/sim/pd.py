"""A prefill/decode cluster in the simulator, with the router's autoscaling policy
(cluster/autoscale.py, the same code) deciding each window: a request is prefilled on a
prefill node, its full blocks reach the decode node at the table's store-read bandwidth (the
daemons' handoff: the store or the wire), its last partial block is computed there, and it
decodes there. A node the policy moves takes no new work, drains, then
serves its new role. Kept apart from cluster.py (the unified simulation)."""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Literal

from daemon.cluster.autoscale import (
    Autoscaler,
    Decision,
    NodeLoad,
    Targets,
    WindowInputs,
    queued,
)
from daemon.cluster.slo_window import SloWindow
from daemon.kv.request_state import PrefixState
from daemon.loop.request import Request, SamplingParams
from daemon.sim.cluster import VOCAB
from daemon.sim.node import NodeConfig, SimNode, Transfer
from daemon.sim.result import percentiles
from daemon.sim.store import SimStore
from daemon.sim.table import CostTable
from daemon.sim.trace import TraceRequest, prompt_tokens

PDRole = Literal["prefill", "decode"]


@dataclass
class PDConfig:
    prefill: int = 1
    decode: int = 1
    node: NodeConfig = field(default_factory=lambda: NodeConfig(2**30, 0, 128, 2048))
    store_bytes: float = float("inf")  # the handoff's path: a store is needed
    targets: Targets | None = None  # None: fixed roles (no autoscaling)
    window_s: float = 10.0
    time_scale: float = 1.0
    handoff_min_tokens: int = 0  # a shorter prompt is computed on its decode node (no handoff)
    # a node's HTTP front: seconds of the node's own time per request leg (parsing,
    # tokenizing, the handoff's calls) before its scheduler has it, taken with the node's next
    # run: on a node of a few cores the event loop and the forward share them; and per prompt
    # token of the leg that takes the request in (tokenizing, the KV export it leads to); and
    # per output token a decode node streams (detokenizing, the event's JSON and write)
    request_s: float = 0.0
    request_s_per_token: float = 0.0
    stream_s_per_token: float = 0.0


@dataclass
class PDRecord:
    index: int
    arrival_s: float
    input_length: int
    output_length: int
    prefill_node: int = -1
    decode_node: int = -1
    first_token_s: float | None = None
    finish_s: float | None = None


@dataclass
class RoleMove:
    node: int
    role: PDRole
    decided_s: float
    switched_s: float


@dataclass
class PDRun:
    cfg: PDConfig
    records: list[PDRecord]
    decisions: list[Decision]
    moves: list[RoleMove]
    role_seconds: dict[str, float]  # node-seconds spent in each role (draining included)
    end_s: float


ARRIVE, LOADED, STEP_DONE, TICK = 0, 1, 2, 3


class _Cluster:
    def __init__(self, table: CostTable, cfg: PDConfig) -> None:
        self.cfg = cfg
        self.store = SimStore(cfg.store_bytes, table.kv.bytes_per_block)
        n = cfg.prefill + cfg.decode
        self.nodes = [SimNode(i, table, cfg.node, self.store) for i in range(n)]
        self.roles: list[PDRole] = ["prefill"] * cfg.prefill + ["decode"] * cfg.decode
        self.draining: dict[int, tuple[PDRole, float, Decision]] = {}  # node -> (new role, ...)
        self.since = [0.0] * n  # when the node took its present role
        self.role_seconds = {"prefill": 0.0, "decode": 0.0}

    def open_nodes(self, role: PDRole) -> list[int]:
        return [i for i, r in enumerate(self.roles) if r == role and i not in self.draining]

    def pick(self, role: PDRole) -> int:
        return min(self.open_nodes(role), key=lambda i: (self.nodes[i].load(), i))

    def inputs(self, now: float, slo: SloWindow) -> WindowInputs:
        ttft, tpot, samples = slo.read(now)
        decode = self.open_nodes("decode")
        usage = [u for i in decode for u in self.nodes[i].kv.usage()]
        blocks = sum(u.num_blocks for u in usage)
        free = sum(u.num_free for u in usage)

        loads = tuple(
            NodeLoad(
                str(i),
                self.roles[i],
                len(self.nodes[i].scheduler.running),
                len(self.nodes[i].scheduler.waiting),
            )
            for role in ("prefill", "decode")
            for i in self.open_nodes(role)  # type: ignore[arg-type]
        )
        util = 1 - free / blocks if blocks else None
        return WindowInputs(
            now, ttft, tpot, util, queued(loads, "prefill"), queued(loads, "decode"), loads,
            samples,
        )  # fmt: skip

    def switch_drained(self, now: float, policy: Autoscaler, moves: list[RoleMove]) -> None:
        for i, (role, decided, decision) in list(self.draining.items()):
            if self.nodes[i].unfinished == 0 and self.nodes[i].running is None:
                del self.draining[i]
                self.role_seconds[self.roles[i]] += now - self.since[i]
                self.roles[i], self.since[i] = role, now
                policy.moved(decision, now)
                moves.append(RoleMove(i, role, decided, now))

    def close(self, now: float) -> None:
        for i, role in enumerate(self.roles):
            self.role_seconds[role] += now - self.since[i]


def simulate_pd(table: CostTable, trace: list[TraceRequest], cfg: PDConfig) -> PDRun:
    """Run `trace` through the P/D cluster to the last request's end."""
    if cfg.prefill < 1 or cfg.decode < 1:
        raise ValueError("a P/D cluster needs a prefill and a decode node")
    c = _Cluster(table, cfg)
    policy = Autoscaler(cfg.targets) if cfg.targets is not None else None
    slo = SloWindow(cfg.window_s)
    records: list[PDRecord] = []
    decisions: list[Decision] = []
    moves: list[RoleMove] = []
    heap: list[tuple[float, int, int, object]] = []
    order = itertools.count()
    legs: dict[str, tuple[Request, PDRecord, bool]] = {}  # request id -> (req, record, decode?)
    for i, t in enumerate(trace):
        heapq.heappush(heap, (t.arrival_s * cfg.time_scale, next(order), ARRIVE, i))
    if policy is not None:
        heapq.heappush(heap, (cfg.window_s, next(order), TICK, None))
    left = len(trace)
    now = 0.0

    def push(at: float, kind: int, what: object) -> None:
        heapq.heappush(heap, (at, next(order), kind, what))

    def kick(n: int) -> None:
        node = c.nodes[n]
        if node.running is not None:
            return
        running, reads = node.start_step(now)
        for read in reads:
            found, seconds = node.store_read(read.request, read.keys)
            push(now + seconds, LOADED, (n, read.request, read.keys, found))
        if running is not None:
            push(running.end_s, STEP_DONE, n)

    def admit(n: int, req: Request, handoff: bool = False) -> None:
        """`handoff`: the prompt's full blocks come from the prefill node (all of them)."""
        c.nodes[n].unfinished += 1
        front = cfg.request_s + (
            0.0 if handoff else cfg.request_s_per_token * req.num_prompt_tokens
        )
        if front > 0:  # through the node's front first, with its next run
            c.nodes[n].transfers.append(Transfer("front", (req, handoff), front))
            kick(n)
            return
        fronted(n, req, handoff)

    def fronted(n: int, req: Request, handoff: bool) -> None:
        node = c.nodes[n]
        keys = node.prefix.store_keys(req)
        if keys and handoff:
            seconds = node.table.store_read.seconds(len(keys) * node.block_bytes)
            push(now + seconds, LOADED, (n, req, keys, len(keys)))
            return
        if keys:
            found, seconds = node.store_read(req, keys)
            push(now + seconds, LOADED, (n, req, keys, found))
            return
        node.scheduler.add(req)
        kick(n)

    def leg(rec: PDRecord, t: TraceRequest, decode: bool) -> Request:
        suffix = "d" if decode else "p"
        max_tokens = t.output_length if decode else 1
        req = Request(
            f"sim-{rec.index}-{suffix}",
            prompt_tokens(t, VOCAB),
            SamplingParams(max_tokens=max(max_tokens, 1), ignore_eos=True),
            arrival=now,
            prefix=PrefixState(),
        )
        legs[req.request_id] = (req, rec, decode)
        return req

    while heap and (left or heap[0][2] != TICK):
        now, _, kind, what = heapq.heappop(heap)
        if kind == ARRIVE:
            assert isinstance(what, int)
            t = trace[what]
            rec = PDRecord(what, now, t.input_length, t.output_length)
            records.append(rec)
            if t.input_length < cfg.handoff_min_tokens:
                rec.decode_node = c.pick("decode")
                admit(rec.decode_node, leg(rec, t, decode=True))
            else:
                rec.prefill_node = c.pick("prefill")
                admit(rec.prefill_node, leg(rec, t, decode=False))
        elif kind == LOADED:
            n, req, keys, found = what  # type: ignore[misc]
            c.nodes[n].loaded(req, keys, found)
            kick(n)
        elif kind == STEP_DONE:
            assert isinstance(what, int)
            finished, carried = c.nodes[what].finish_step()
            for t in carried:  # fronts done: their requests reach the scheduler
                if t.kind == "front":
                    fronted(what, *t.job)  # type: ignore[misc]
            streamed = sum(legs[req.request_id][2] for req, _ in finished)
            if cfg.stream_s_per_token > 0 and streamed:  # paid with the node's next run
                c.nodes[what].transfers.append(
                    Transfer("stream", None, cfg.stream_s_per_token * streamed)
                )
            for req, done in finished:
                _, rec, decode = legs[req.request_id]
                if decode and rec.first_token_s is None:
                    rec.first_token_s = now
                if not done:
                    continue
                del legs[req.request_id]
                if not decode:  # the handoff
                    rec.decode_node = c.pick("decode")
                    admit(rec.decode_node, leg(rec, trace[rec.index], decode=True), handoff=True)
                    continue
                rec.finish_s = now
                left -= 1
                assert rec.first_token_s is not None
                tpot = (
                    (now - rec.first_token_s) / (rec.output_length - 1)
                    if rec.output_length > 1
                    else None
                )
                slo.add(now, rec.first_token_s - rec.arrival_s, tpot)
            kick(what)
            if policy is not None:
                c.switch_drained(now, policy, moves)
        else:
            assert policy is not None
            push(now + cfg.window_s, TICK, None)
            c.switch_drained(now, policy, moves)
            if c.draining:  # as the router, which waits for its move: no decision meanwhile
                continue
            d = policy.decide(c.inputs(now, slo))
            decisions.append(d)
            if d.node_id is not None:
                new: PDRole = "decode" if d.kind == "prefill_to_decode" else "prefill"
                c.draining[int(d.node_id)] = (new, now, d)
                c.switch_drained(now, policy, moves)
    c.close(now)
    return PDRun(cfg, records, decisions, moves, c.role_seconds, now)


def summarize_pd(run: PDRun, slo: Targets | None = None) -> dict:
    """TTFT / TPOT, SLO attainment (a request within both targets of `slo`, by default the
    run's own, else the defaults), node-seconds by role, every decision with its inputs and
    every move."""
    t = slo or run.cfg.targets or Targets()
    done = [r for r in run.records if r.finish_s is not None and r.first_token_s is not None]
    ttft = [r.first_token_s - r.arrival_s for r in done]  # type: ignore[operator]
    tpot = {
        r.index: (r.finish_s - r.first_token_s) / (r.output_length - 1)  # type: ignore[operator]
        for r in done
        if r.output_length > 1
    }
    met = sum(
        1
        for r, f in zip(done, ttft, strict=True)
        if f <= t.ttft_p99_s and tpot.get(r.index, 0.0) <= t.tpot_p99_s
    )
    return {
        "config": {
            "prefill": run.cfg.prefill,
            "decode": run.cfg.decode,
            "autoscale": run.cfg.targets is not None,
            "window_s": run.cfg.window_s,
            "time_scale": run.cfg.time_scale,
        },
        "requests": len(run.records),
        "finished": len(done),
        "simulated_s": run.end_s,
        "ttft_s": percentiles(ttft),
        "tpot_s": percentiles(list(tpot.values())),
        "slo": {
            "ttft_s": t.ttft_p99_s,
            "tpot_s": t.tpot_p99_s,
            "attainment": met / len(done) if done else math.nan,
        },
        "node_seconds": run.role_seconds | {"total": sum(run.role_seconds.values())},
        "decisions": [d.to_json() for d in run.decisions],
        "moves": [vars(m) for m in run.moves],
    }

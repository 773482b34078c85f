"""The discrete-event simulation: a plain event heap (time, order, event). A heap rather than
SimPy: every node's life is "step, then the next step", driven by our own scheduler's calls,
with no resources or processes to model, so a coroutine framework would add only a
dependency and per-event overhead; the heap keeps the hour-long trace within minutes."""

from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from daemon.kv.request_state import PrefixState
from daemon.loop.request import Request, SamplingParams
from daemon.sim.node import NodeConfig, SimNode
from daemon.sim.router import route
from daemon.sim.store import SimStore
from daemon.sim.table import CostTable
from daemon.sim.trace import TraceRequest, prompt_tokens

VOCAB = 1 << 20  # token ids the trace's blocks are spelled in (the simulator runs no model)


@dataclass
class ClusterConfig:
    nodes: int = 1
    node: NodeConfig = field(default_factory=lambda: NodeConfig(2**30, 4 * 2**30, 128, 2048))
    store_bytes: float = 0.0  # 0: no block store; float('inf'): unlimited
    policy: str = "least-loaded"
    time_scale: float = 1.0  # arrival times are multiplied by this (2: half the rate)


@dataclass
class RequestRecord:
    index: int
    node: int
    arrival_s: float
    input_length: int
    output_length: int
    first_token_s: float | None = None
    finish_s: float | None = None
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    rejected: bool = False


@dataclass
class Sample:
    """The cluster at one instant: requests running, waiting and loading, over all nodes."""

    time_s: float
    running: int
    waiting: int
    loading: int


@dataclass
class SimRun:
    cfg: ClusterConfig
    nodes: list[SimNode]
    store: SimStore | None
    records: list[RequestRecord]
    samples: list[Sample]
    end_s: float
    wall_s: float
    events: int  # taken from the heap (fewer than steps where decode runs were taken at once)


ARRIVE, LOADED, STEP_DONE = 0, 1, 2
# an event's place in the heap: (time, 0, trace index) for arrivals, which go first at a
# time, then (time, 1, issued at, 0, issue count) for store reads and (time, 1, launched at,
# 1, node) for steps: an order that does not depend on how many steps ran in between
Key = tuple[float, ...]


def simulate(
    table: CostTable,
    trace: list[TraceRequest],
    cfg: ClusterConfig,
    progress: bool = True,
    sample_every_s: float = 1.0,
    step_by_step: bool = False,
) -> SimRun:
    """Run `trace` through `cfg.nodes` nodes to the last request's end. A node whose next
    steps are plain decodes of the same requests (SimNode.steady_steps) takes them at once,
    up to the next arrival, store read of its own or sample; `step_by_step`: one event per step
    (the same result, slower)."""
    started = time.perf_counter()
    bb = table.kv.bytes_per_block
    store = SimStore(cfg.store_bytes, bb) if cfg.store_bytes else None
    nodes = [SimNode(i, table, cfg.node, store) for i in range(cfg.nodes)]
    records: list[RequestRecord] = []
    samples: list[Sample] = []
    heap: list[tuple[Key, int, object]] = []
    arrivals = [t.arrival_s * cfg.time_scale for t in trace]
    for i, t in enumerate(arrivals):
        heapq.heappush(heap, ((t, 0, i), ARRIVE, i))
    arrived = 0
    reads = itertools.count()
    pending_reads: list[list[float]] = [[] for _ in nodes]  # each node's reads' end times
    reqs: dict[str, tuple[Request, RequestRecord]] = {}
    loading = 0
    now = 0.0
    next_sample = 0.0
    bar = tqdm(total=len(trace), desc="simulating", unit="req", disable=not progress)

    def read(node: SimNode, req: Request, keys: list[bytes]) -> None:
        nonlocal loading
        found, seconds = node.store_read(req, keys)
        loading += 1
        end = now + seconds
        pending_reads[node.index].append(end)
        heapq.heappush(heap, ((end, 1, now, 0, next(reads)), LOADED, (node, req, keys, found)))

    def kick(node: SimNode) -> None:
        if node.running is not None:
            return
        start = now
        steps = 0 if step_by_step else node.steady_steps()
        if steps:
            # what could see or change the node meanwhile: an arrival (the router reads every
            # node), its own store reads, the next sample of the queues
            until = min(
                arrivals[arrived] if arrived < len(arrivals) else math.inf,
                min(pending_reads[node.index], default=math.inf),
                next_sample,
            )
            start = node.run_steady(now, until, steps)
        running, wanted = node.start_step(start)
        for r in wanted:  # in-memory prefix evicted while it waited: read the store again
            read(node, r.request, r.keys)
        if running is not None:
            heapq.heappush(heap, ((running.end_s, 1, start, 1, node.index), STEP_DONE, node))

    events = 0
    try:
        while heap:
            key, kind, what = heapq.heappop(heap)
            events += 1
            now = key[0]
            while now >= next_sample:
                samples.append(_sample(next_sample, nodes, loading))
                next_sample += sample_every_s
            if kind == ARRIVE:
                assert isinstance(what, int)
                arrived += 1
                t = trace[what]
                req = Request(
                    f"sim-{what}",
                    prompt_tokens(t, VOCAB),
                    SamplingParams(max_tokens=t.output_length, ignore_eos=True),
                    arrival=now,
                    prefix=PrefixState(),
                )
                keys = nodes[0].prefix.keys(req)  # one salt for every node: the same keys
                n = route(cfg.policy, nodes, keys)
                node = nodes[n]
                rec = RequestRecord(what, n, now, t.input_length, t.output_length)
                records.append(rec)
                if t.input_length + t.output_length > node.kv.capacity_tokens():
                    rec.rejected = True  # as Engine.add_request refuses it
                    bar.update()
                    continue
                reqs[req.request_id] = (req, rec)
                node.unfinished += 1
                store_keys = node.prefix.store_keys(req)
                if store_keys:
                    read(node, req, store_keys)
                    continue
                node.scheduler.add(req)
                kick(node)
            elif kind == LOADED:
                node, req, keys, found = what  # type: ignore[misc]
                loading -= 1
                pending_reads[node.index].remove(now)
                node.loaded(req, keys, found)
                kick(node)
            else:
                node = what  # type: ignore[assignment]
                for req, done in node.finish_step():
                    rec = reqs[req.request_id][1]
                    if rec.first_token_s is None:
                        rec.first_token_s = now
                    if done:
                        rec.finish_s = now
                        rec.cached_by_tier = dict(req.cache.tokens_by_tier)
                        del reqs[req.request_id]
                        bar.update()
                kick(node)
    finally:
        bar.close()
    samples.append(_sample(now, nodes, loading))
    return SimRun(cfg, nodes, store, records, samples, now, time.perf_counter() - started, events)


def _sample(t: float, nodes: list[SimNode], loading: int) -> Sample:
    return Sample(
        t,
        sum(len(n.scheduler.running) for n in nodes),
        sum(len(n.scheduler.waiting) for n in nodes),
        loading,
    )

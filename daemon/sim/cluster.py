"""The discrete-event simulation: a plain event heap (time, order, event) over unified nodes,
or prefill / decode pairs with the KV handed over a link. A heap rather than
SimPy: every node's life is "step, then the next step", driven by our own scheduler's calls,
with no resources or processes to model, so a coroutine framework would add only a
dependency and per-event overhead; the heap keeps the hour-long trace within minutes."""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tqdm import tqdm

from daemon.cluster.node import Role
from daemon.cluster.router import PrefillBalance
from daemon.kv.request_state import PrefixState
from daemon.loop.request import Request, SamplingParams
from daemon.sim.cost import handoff
from daemon.sim.node import NodeConfig, Running, SimNode, Transfer
from daemon.sim.router import PairRouter, route
from daemon.sim.store import SimStore
from daemon.sim.table import Bandwidth, CostTable
from daemon.sim.trace import TraceRequest, prompt_tokens

VOCAB = 1 << 20  # token ids the trace's blocks are spelled in (the simulator runs no model)


@dataclass
class ClusterConfig:
    nodes: int = 1  # unified nodes
    node: NodeConfig = field(default_factory=lambda: NodeConfig(2**30, 4 * 2**30, 128, 2048))
    store_bytes: float = 0.0  # 0: no block store; float('inf'): unlimited
    policy: str = "least-loaded"  # among unified nodes
    time_scale: float = 1.0  # arrival times are multiplied by this (2: half the rate)
    prefill: int = 0  # prefill nodes, after the unified ones
    decode: int = 0  # decode nodes, after the prefill ones
    # the KV handoff from a prefill to a decode node: bytes of the prompt's KV blocks, one
    # handoff at a time on each prefill node's link
    link: Bandwidth = field(default_factory=lambda: Bandwidth(25e9, 1e-4))
    # clients: at most this many requests in flight (0: no bound); a request arriving while as
    # many are in flight is sent when one finishes, as `bench serve --max-concurrency` does
    max_concurrency: int = 0
    # a serving node's HTTP front: seconds it takes per request (parsing, the codec) before its
    # scheduler has it, one request at a time (the event loop); 0: none
    request_s: float = 0.0
    # the engine's overlap (`serve --overlap`): a node schedules its next step while one runs,
    # so what arrives during a step waits for the one after the next
    overlap: bool = False
    # the router's prefill route for pairs: prefix holder preferred within these load bounds
    balance: PrefillBalance = field(default_factory=PrefillBalance)

    @property
    def total_nodes(self) -> int:
        return self.nodes + self.prefill + self.decode

    def roles(self) -> list[Role]:
        out: list[Role] = ["unified"] * self.nodes
        return out + ["prefill"] * self.prefill + ["decode"] * self.decode


@dataclass(frozen=True)
class SLO:
    ttft_p99_s: float
    tpot_p99_s: float


@dataclass
class RequestRecord:
    index: int
    node: int  # where it decoded (and, on a unified node, was prefilled)
    arrival_s: float
    input_length: int
    output_length: int
    first_token_s: float | None = None
    finish_s: float | None = None
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    rejected: bool = False
    prefill_node: int | None = None  # a prefill / decode pair's prefill node
    handoff_bytes: int = 0
    # a pair's phases: when the decode node reserved its blocks (its prefill may start), when
    # the prefill node computed it, when its KV was imported on the decode node
    reserved_s: float | None = None
    prefilled_s: float | None = None
    handoff_s: float | None = None


@dataclass
class Sample:
    """The cluster at one instant: requests running, waiting and loading, over all nodes, and
    the nodes of each role."""

    time_s: float
    running: int
    waiting: int
    loading: int
    roles: dict[str, int] = field(default_factory=dict)


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


@dataclass
class Job:
    """One trace request: the request that decodes and, for a pair, its prefill part."""

    req: Request
    rec: RequestRecord
    node: SimNode  # where it decodes
    prefill: Request | None = None
    prefill_node: SimNode | None = None


ARRIVE, LOADED, STEP_DONE, HANDOFF, SEND, RECEIVED = 0, 1, 2, 3, 4, 5
# an event's place in the heap: (time, 0, trace index) for arrivals and sends (a request held
# by the clients' concurrency bound), which go first at a time, then (time, 1, issued at, 0,
# issue count) for store reads, handoffs and requests through a node's HTTP front, and (time,
# 1, launched at, 1, node) for steps: an order that does not depend on how many steps ran in
# between
Key = tuple[float, ...]


def simulate(
    table: CostTable,
    trace: list[TraceRequest],
    cfg: ClusterConfig,
    progress: bool = True,
    sample_every_s: float = 1.0,
    step_by_step: bool = False,
) -> SimRun:
    """Run `trace` through the cluster to the last request's end. A node whose next steps are
    plain decodes of the same requests (SimNode.steady_steps) takes them at once, up to the
    next event that could see or change it; `step_by_step`: one event per step (the same
    result, slower)."""
    sim = Simulation(table, trace, cfg, sample_every_s, step_by_step)
    bar = tqdm(total=len(trace), desc="simulating", unit="req", disable=not progress)
    try:
        sim.run(bar.update)
    finally:
        bar.close()
    return sim.result()


class Simulation:
    """The event loop. A request arriving while the cluster has prefill and decode nodes goes
    to a pair the real Router picks: the decode node reserves the prompt's KV blocks (waiting
    for room, as Handoffs does), the prefill node computes the prompt less its last token (as
    Engine.prefill_export), the KV crosses the link, and the decode node computes the last
    token and decodes. Otherwise it goes to a unified node (`route`)."""

    def __init__(
        self,
        table: CostTable,
        trace: list[TraceRequest],
        cfg: ClusterConfig,
        sample_every_s: float = 1.0,
        step_by_step: bool = False,
        slo: SLO | None = None,
    ) -> None:
        """`slo`: stop as soon as the TTFT or TPOT p99 of the whole trace is sure to miss it
        (more requests late than the 1 % that p99 allows): `missed` then says which."""
        self.started = time.perf_counter()
        self.table, self.trace, self.cfg = table, trace, cfg
        self.sample_every_s, self.step_by_step = sample_every_s, step_by_step
        self.store = (
            SimStore(cfg.store_bytes, table.kv.bytes_per_block) if cfg.store_bytes else None
        )
        self.nodes = [
            SimNode(i, table, cfg.node, self.store, role) for i, role in enumerate(cfg.roles())
        ]
        self.records: list[RequestRecord] = []
        self.samples: list[Sample] = []
        self.heap: list[tuple[Key, int, object]] = []
        self.arrivals = [t.arrival_s * cfg.time_scale for t in trace]
        for i, t in enumerate(self.arrivals):
            heapq.heappush(self.heap, ((t, 0, i), ARRIVE, i))
        self.arrived = 0
        self.in_flight = 0  # sent, not finished or refused
        self.held: deque[int] = deque()  # arrived, not sent: the concurrency bound is reached
        self.sending = 0  # held requests whose send is in the heap (at the current time)
        self.front_free = [0.0 for _ in self.nodes]  # when each node's HTTP front is free
        self.link_free = [0.0 for _ in self.nodes]  # when each prefill node's link is free
        self.issues = itertools.count()
        # each node's own coming events (store reads, handoffs to it): their times
        self.pending: list[list[float]] = [[] for _ in self.nodes]
        self.reserving: list[deque[Job]] = [deque() for _ in self.nodes]  # decode side
        # a decode node's jobs in prefill, by prefill node
        self.prefilling: list[Counter[int]] = [Counter() for _ in self.nodes]
        self.jobs: dict[str, Job] = {}
        self.pairs = PairRouter(lambda: self.now, cfg.balance)
        self.loading = 0
        self.now = 0.0
        self.next_sample = 0.0
        self.events = 0
        self.slo = slo
        self.missed: str | None = None
        self.late = {"ttft": 0, "tpot": 0}
        # nearest-rank p99 of n values exceeds the SLO once more than n - ceil(0.99 n) do
        self.allowed = {
            "ttft": len(trace) - math.ceil(0.99 * len(trace)),
            "tpot": (n := sum(t.output_length > 1 for t in trace)) - math.ceil(0.99 * n),
        }

    def run(self, finished: Callable[[], object] = lambda: None) -> None:
        """`finished`: told of each request done (or refused)."""
        self.finished = finished
        while self.heap and self.missed is None:
            key, kind, what = heapq.heappop(self.heap)
            self.events += 1
            self.now = key[0]
            while self.now >= self.next_sample:
                self.samples.append(self._sample(self.next_sample))
                self.next_sample += self.sample_every_s
            if kind == ARRIVE:
                self.arrived += 1
                if 0 < self.cfg.max_concurrency <= self.in_flight + len(self.held):
                    self.held.append(what)  # type: ignore[arg-type]
                else:
                    self._arrive(what)  # type: ignore[arg-type]
            elif kind == SEND:
                self.sending -= 1
                self._arrive(what)  # type: ignore[arg-type]
            elif kind == LOADED:
                node, req, keys, found = what  # type: ignore[misc]
                self.loading -= 1
                self.pending[node.index].remove(self.now)
                node.loaded(req, keys, found)
                self._kick(node)
            elif kind == RECEIVED:
                job = what
                assert isinstance(job, Job)
                self.pending[job.node.index].remove(self.now)
                self._received(job)
            elif kind == HANDOFF:
                job = what
                assert isinstance(job, Job)
                self.pending[job.node.index].remove(self.now)
                # the decode node imports it with its next run (Handoffs._import)
                _, _, seconds = handoff(self.table, job.req.num_prompt_tokens - 1)
                job.node.transfers.append(Transfer("import", job, seconds))
                self._kick(job.node)
            else:
                self._step_done(what)  # type: ignore[arg-type]

    def result(self) -> SimRun:
        self.samples.append(self._sample(self.now))
        wall = time.perf_counter() - self.started
        return SimRun(
            self.cfg, self.nodes, self.store, self.records, self.samples, self.now, wall,
            self.events,
        )  # fmt: skip

    # ---- events ------------------------------------------------------------------------------

    def _arrive(self, i: int) -> None:
        self.in_flight += 1
        t = self.trace[i]
        prompt = prompt_tokens(t, VOCAB)
        req = self._request(f"sim-{i}", prompt, t.output_length)
        keys = self.nodes[0].prefix.keys(req)  # one salt for every node: the same keys
        paired = len(prompt) > 1 and any(n.role != "unified" for n in self.nodes)
        pair = self.pairs.pick(self.nodes, keys) if paired else None
        if pair is None:  # no pair: a unified node (or, lacking one, any) computes it all
            unified = [n for n in self.nodes if n.role == "unified"]
            unified = unified or [n for n in self.nodes if n.role == "decode"] or self.nodes
            node = unified[route(self.cfg.policy, unified, keys)]
            prefill_node = None
        else:
            node, prefill_node = self.nodes[pair[0]], self.nodes[pair[1]]
        rec = RequestRecord(i, node.index, self.now, t.input_length, t.output_length)
        self.records.append(rec)
        if t.input_length + t.output_length > node.kv.capacity_tokens() or (
            prefill_node is not None and t.input_length > prefill_node.kv.capacity_tokens()
        ):
            rec.rejected = True  # as Engine.add_request refuses it
            if pair is not None:
                self.pairs.done(node)
            self._finished()
            return
        job = Job(req, rec, node, prefill_node=prefill_node)
        self.jobs[req.request_id] = job
        node.unfinished += 1
        if self.cfg.request_s <= 0:
            self._received(job)
            return
        # the node's HTTP front takes the requests one at a time
        end = max(self.now, self.front_free[node.index]) + self.cfg.request_s
        self.front_free[node.index] = end
        self.pending[node.index].append(end)
        self._push(end, RECEIVED, job)

    def _received(self, job: Job) -> None:
        """The serving node has the request: it waits for admission, or (a pair) reserves the
        prompt's blocks for its handoff."""
        node, req = job.node, job.req
        if job.prefill_node is None:
            self._enqueue(node, req)
            return
        job.rec.prefill_node = job.prefill_node.index
        job.prefill = self._request(f"{req.request_id}-prefill", req.prompt_ids[:-1], 1)
        self.reserving[node.index].append(job)
        self._reserve(node)
        self._kick(node)  # the reservation may have demoted cached blocks: copy them out

    def _request(self, request_id: str, prompt: list[int], max_tokens: int) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return Request(request_id, prompt, params, arrival=self.now, prefix=PrefixState())

    def _enqueue(self, node: SimNode, req: Request) -> None:
        """The request waits for admission, once its store read (if any) is back."""
        store_keys = node.prefix.store_keys(req)
        if store_keys:
            self._read(node, req, store_keys)
            return
        node.scheduler.add(req)
        self._kick(node)

    def _reserve(self, node: SimNode) -> None:
        """The decode node reserves the prompt's blocks of its handoffs in arrival order; each
        reserved one starts its prefill."""
        queue = self.reserving[node.index]
        while queue and node.kv.grow(queue[0].req.request_id, queue[0].req.num_prompt_tokens):
            job = queue.popleft()
            assert job.prefill is not None and job.prefill_node is not None
            job.rec.reserved_s = self.now
            self.jobs[job.prefill.request_id] = job
            self.prefilling[node.index][job.prefill_node.index] += 1
            job.prefill_node.unfinished += 1
            self._enqueue(job.prefill_node, job.prefill)

    def _step_done(self, node: SimNode) -> None:
        outputs, transfers = node.finish_step()
        for req, done in outputs:
            job = self.jobs[req.request_id]
            if req is job.prefill:
                self._prefilled(job)
                continue
            rec = job.rec
            if rec.first_token_s is None:
                rec.first_token_s = self.now
                if self.slo is not None and self.now - rec.arrival_s > self.slo.ttft_p99_s:
                    self._late("ttft")
            if done:
                rec.finish_s = self.now
                if self.slo is not None and rec.output_length > 1:
                    tpot = (self.now - rec.first_token_s) / (rec.output_length - 1)
                    if tpot > self.slo.tpot_p99_s:
                        self._late("tpot")
                if job.prefill is None:
                    rec.cached_by_tier = dict(req.cache.tokens_by_tier)
                else:
                    self.pairs.done(node)
                del self.jobs[req.request_id]
                self._finished()
        for t in transfers:
            assert isinstance(t.job, Job)
            if t.kind == "export":
                self._send(t.job)
            else:
                self._imported(t.job)
        # the step queued under overlap runs now; the one after it is scheduled once this
        # step's outputs are taken (its exports go with that one), as the engine does
        if node.running is not None:
            self._launched(node, node.running, self.now)
        if self.reserving[node.index]:
            self._reserve(node)
        self._kick(node)

    def _finished(self) -> None:
        """A request is done (or refused): its client's slot sends the next one held."""
        self.in_flight -= 1
        if self.held:
            i = self.held.popleft()
            self.sending += 1
            heapq.heappush(self.heap, ((self.now, 0, i), SEND, i))
        self.finished()

    def _late(self, what: str) -> None:
        self.late[what] += 1
        if self.late[what] > self.allowed[what]:
            self.missed = what

    def _prefilled(self, job: Job) -> None:
        """The prefill part computed its prompt (its one sample unused): its KV is read out
        with the prefill node's next run (Engine._prefilled queues the export; it is back
        when that whole run is), whole blocks of the model's layout."""
        assert job.prefill is not None and job.prefill_node is not None
        del self.jobs[job.prefill.request_id]
        job.rec.prefilled_s = self.now
        job.rec.cached_by_tier = dict(job.prefill.cache.tokens_by_tier)
        nbytes, seconds, _ = handoff(self.table, job.req.num_prompt_tokens - 1)
        job.rec.handoff_bytes = nbytes
        job.prefill_node.transfers.append(Transfer("export", job, seconds))

    def _send(self, job: Job) -> None:
        """The export is read: to the decode node over the link. A prefill node sends its
        handoffs one at a time, each its latency (the HTTP legs) and its bytes at the
        link's bandwidth."""
        assert job.prefill_node is not None
        self.prefilling[job.node.index][job.prefill_node.index] -= 1
        p = job.prefill_node.index
        end = max(self.now, self.link_free[p]) + self.cfg.link.seconds(job.rec.handoff_bytes)
        self.link_free[p] = end
        self._push(end, HANDOFF, job)
        self.pending[job.node.index].append(end)

    def _imported(self, job: Job) -> None:
        """The decode node's run that imported the KV is done: the request waits for
        admission with the prompt less its last token computed."""
        job.rec.handoff_s = self.now
        job.req.num_computed = job.req.num_prompt_tokens - 1  # as Handoffs._import
        job.node.scheduler.add(job.req)

    # ---- nodes ------------------------------------------------------------------------------

    def _push(self, end: float, kind: int, what: object) -> None:
        heapq.heappush(self.heap, ((end, 1, self.now, 0, next(self.issues)), kind, what))

    def _read(self, node: SimNode, req: Request, keys: list[bytes]) -> None:
        found, seconds = node.store_read(req, keys)
        self.loading += 1
        end = self.now + seconds
        self.pending[node.index].append(end)
        self._push(end, LOADED, (node, req, keys, found))

    def _kick(self, node: SimNode) -> None:
        if node.running is not None:
            return
        start = self.now
        steps = 0 if self.step_by_step or self.cfg.overlap else node.steady_steps()
        if steps:
            start = node.run_steady(self.now, self._quiet_until(node), steps)
        running, wanted = node.start_step(start)
        now, self.now = self.now, start
        for r in wanted:  # in-memory prefix evicted while it waited: read the store again
            self._read(node, r.request, r.keys)
        self.now = now
        if running is not None:
            self._launched(node, running, start)

    def _launched(self, node: SimNode, running: Running, start: float) -> None:
        """The step (launched at `start`) ends in an event; under overlap the next step is
        scheduled now, as the engine does once it has launched one."""
        key = (running.end_s, 1, start, 1, node.index)
        heapq.heappush(self.heap, (key, STEP_DONE, node))
        if self.cfg.overlap and node.queued is None:
            _, wanted = node.queue_step()
            for r in wanted:
                self._read(node, r.request, r.keys)

    def _quiet_until(self, node: SimNode) -> float:
        """Before when nothing can see or change the node: the next arrival (the router reads
        every node), its own store reads and handoffs, the end of a step on a prefill node
        holding a request it will decode (plus the link's latency), the next sample; with requests
        held by the concurrency bound, the end of any node's step (it may finish a request,
        which sends the next), and now while a send is due."""
        until = min(
            self.arrivals[self.arrived] if self.arrived < len(self.arrivals) else math.inf,
            min(self.pending[node.index], default=math.inf),
            self.next_sample,
        )
        for i, n in self.prefilling[node.index].items():
            if n:
                p = self.nodes[i].running
                until = min(
                    until, (p.end_s if p is not None else self.now) + self.cfg.link.latency_s
                )
        if self.sending:
            until = self.now
        if self.held:
            ends = (n.running.end_s for n in self.nodes if n.running is not None)
            until = min(until, min(ends, default=math.inf))
        return until

    def _sample(self, t: float) -> Sample:
        return Sample(
            t,
            sum(len(n.scheduler.running) for n in self.nodes),
            sum(len(n.scheduler.waiting) for n in self.nodes),
            self.loading,
            dict(Counter(n.role for n in self.nodes)),
        )

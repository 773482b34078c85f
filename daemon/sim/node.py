"""One simulated node: the real KV manager, prefix cache (device / host / store tiers) and
Scheduler, stepped by the simulator with each step's time from the cost table and its tier
copies (and block-store reads) from the table's bandwidths. Its role (unified, prefill,
decode) is a field the cluster reads per request, so it may change during a run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from daemon.cluster.node import NodeInfo, Role
from daemon.kv.host_tier import HostTier
from daemon.kv.manager import KVManager
from daemon.kv.prefix import PrefixCache
from daemon.kv.spec import FullAttentionSpec, KVGroup
from daemon.kv.tier_ops import CacheOps, TierQueue
from daemon.loop.request import FinishReason, Request, RequestStatus
from daemon.loop.scheduler import Scheduler, SchedulerStep, StoreRead
from daemon.sim.cost import StepCost
from daemon.sim.moe import SimExperts
from daemon.sim.moe_config import MoEConfig
from daemon.sim.router import FINGERPRINT, MODEL
from daemon.sim.spec import SimSpeculation
from daemon.sim.spec_config import SpecConfig
from daemon.sim.store import SimStore
from daemon.sim.table import CostTable

SALT = b"deepinfer-sim-1"  # every node serves one model: one key space, as daemons sharing a store
MIN_STEP_S = 1e-6  # a step takes time, so the clock moves


@dataclass
class NodeConfig:
    device_kv_bytes: float
    host_bytes: float  # 0: no host tier
    max_num_seqs: int
    max_num_batched_tokens: int
    moe: MoEConfig | None = None  # a MoE model under expert parallelism (sim/moe.py)
    spec: SpecConfig | None = None  # speculative decoding (sim/spec.py)


@dataclass
class Transfer:
    """A KV handoff's copy on a node's device thread: the prefill node's export (device to
    host) or the decode node's import. As the engine does (loop/transfer.py), it runs with the
    node's next run, before that run's forward, and is done only when the whole run ends.
    ("front": a request's HTTP front on a node whose cores it shares, "stream": the tokens a
    step gave streamed out the same way; sim/pd.py.)"""

    kind: Literal["export", "import", "front", "stream"]
    job: object  # the cluster's, given back when the run ends
    seconds: float


@dataclass
class Running:
    """A step on the node's device (or its cache ops and transfers alone): what ends at
    `end_s`."""

    step: SchedulerStep | None
    ops: CacheOps
    end_s: float
    transfers: list[Transfer] = field(default_factory=list)


@dataclass
class NodeCounters:
    steps: int = 0
    busy_s: float = 0.0
    host_bytes_saved: int = 0
    host_bytes_loaded: int = 0
    store_read_bytes: int = 0
    preemptions: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0


class SimNode:
    def __init__(
        self,
        index: int,
        table: CostTable,
        cfg: NodeConfig,
        store: SimStore | None,
        role: Role = "unified",
    ) -> None:
        g = table.kv
        dtype = getattr(torch, g.dtype)
        spec = FullAttentionSpec(g.block_size, g.num_layers, dtype, g.num_kv_heads, g.head_dim)
        groups = [KVGroup(spec, tuple(range(g.num_layers)))]
        self.index, self.table, self.cost = index, table, StepCost(table)
        self.role: Role = role
        self.node_id = f"sim-{index:04d}"  # the router orders peers by id: as by index
        self.block_bytes = g.bytes_per_block
        self.host = HostTier(cfg.host_bytes) if cfg.host_bytes else None
        self.queue = TierQueue(self.host, self.block_bytes)
        self.kv = KVManager(
            groups, int(cfg.device_kv_bytes), cfg.max_num_seqs, on_evict=self.queue.demote
        )
        self.store = store
        self.prefix = PrefixCache(self.kv, self.queue, SALT, store=store)  # type: ignore[arg-type]
        self.spec = (
            SimSpeculation(cfg.spec, table, index, self._mean_context)
            if cfg.spec is not None
            else None
        )
        self.scheduler = Scheduler(
            self.kv, cfg.max_num_seqs, cfg.max_num_batched_tokens, self.prefix,
            self.spec.speculator if self.spec is not None else None,
        )  # fmt: skip
        # what a block copied to host memory holds: a stride-0 view, its size without its bytes
        self._payload = torch.zeros(1, dtype=torch.uint8).expand(self.block_bytes)
        self.running: Running | None = None
        # with overlap: the step scheduled while `running` runs, to start when it ends
        self.queued: Running | None = None
        self.transfers: list[Transfer] = []  # for the next run
        self.unfinished = 0  # requests routed here and not finished
        self.counters = NodeCounters()
        self.experts = SimExperts(cfg.moe, index) if cfg.moe is not None else None

    # ---- requests ------------------------------------------------------------------------

    def store_read(self, req: Request, keys: list[bytes]) -> tuple[int, float]:
        """Read the request's chain from the store now: (blocks found, seconds it takes)."""
        assert self.store is not None
        n = self.store.read_chain(keys)
        nbytes = n * self.block_bytes
        self.counters.store_read_bytes += nbytes
        return n, self.table.store_read.seconds(max(nbytes, 1))

    def loaded(self, req: Request, keys: list[bytes], found: int) -> None:
        """The request's store read is back with `found` blocks: it waits for admission."""
        self.prefix.receive(req, keys, [self._payload] * found)
        self.scheduler.add(req)

    # ---- steps ---------------------------------------------------------------------------

    def start_step(self, now: float) -> tuple[Running | None, list[StoreRead]]:
        """Schedule and launch the next step (or the cache ops waiting alone): what runs and
        until when, and the store reads the scheduler asked for. (None, ...) while idle."""
        assert self.running is None
        self.running, reads = self._schedule(now)
        return self.running, reads

    def queue_step(self) -> tuple[Running | None, list[StoreRead]]:
        """Overlap (the engine's 3-stage loop): schedule the step after the running one now,
        while it runs (its decodes' last tokens still on the device), to start when it ends."""
        assert self.running is not None and self.queued is None
        self.queued, reads = self._schedule(self.running.end_s)
        return self.queued, reads

    def _schedule(self, start: float) -> tuple[Running | None, list[StoreRead]]:
        step = self.scheduler.schedule()
        reads = list(step.store_reads) if step is not None else []
        if step is not None and not step.seqs:
            step = None
        ops = self.prefix.take_ops()
        transfers, self.transfers = self.transfers, []
        if step is None and not ops and not transfers:
            return None, reads
        saves, loads = len(ops.block_saves), len(ops.block_loads)
        for save in ops.block_saves:  # the device worker's copy to host memory
            save.entry.payload = self._payload
        seconds = self.table.host_save.seconds(saves * self.block_bytes)
        seconds += self.table.host_load.seconds(loads * self.block_bytes)
        seconds += sum(t.seconds for t in transfers)
        c = self.counters
        c.host_bytes_saved += saves * self.block_bytes
        c.host_bytes_loaded += loads * self.block_bytes
        if step is not None:
            seconds += self._forward(self.cost.seconds(step), sum(s.num_tokens for s in step.seqs))
            c.steps += 1
            for s in step.seqs:
                if s.is_decode or s.draft:
                    c.decode_tokens += 1
                else:
                    c.prefill_tokens += s.num_tokens
        seconds = max(seconds, MIN_STEP_S)
        c.busy_s += seconds
        return Running(step, ops, start + seconds, transfers), reads

    def _mean_context(self) -> float:
        running = self.scheduler.running
        return sum(r.num_computed for r in running) / len(running) if running else 0.0

    def _forward(self, seconds: float, tokens: int) -> float:
        """A forward of `tokens` tokens that the table says takes `seconds`: on a MoE node,
        stretched by its experts' imbalance (and counted toward their statistics)."""
        if self.experts is None:
            return seconds
        draw = self.experts.draw(tokens, seconds)
        self.experts.take(draw)
        return draw.seconds

    def finish_step(self) -> tuple[list[tuple[Request, bool]], list[Transfer]]:
        """The running step is done: its tokens, as (request, finished) for each sample, and
        the transfers it carried; the queued step (overlap) runs now."""
        running, self.running, self.queued = self.running, self.queued, None
        assert running is not None
        self.prefix.completed(running.ops)
        out: list[tuple[Request, bool]] = []
        if running.step is None:
            return out, running.transfers
        for seq in running.step.seqs:
            req = seq.request
            req.num_inflight_steps -= 1
            if not seq.samples:
                continue
            tokens = 1  # and a verify's accepted drafts
            if self.spec is not None and seq.proposal is not None:
                tokens += self.spec.verified(seq, self.scheduler)
            if req.finished:
                continue
            tokens = min(tokens, req.params.max_tokens - len(req.output_ids))
            req.output_ids.extend([OUTPUT_TOKEN] * tokens)
            done = len(req.output_ids) >= req.params.max_tokens
            if done:
                self.scheduler.finish(req, FinishReason.LENGTH)
                if self.spec is not None:
                    self.spec.speculator.finished(req)
                self.unfinished -= 1
            out.append((req, done))
        self.counters.preemptions = self.scheduler.num_preemptions
        return out, running.transfers

    # ---- decode runs between events ----------------------------------------------------------

    def steady_steps(self) -> int:
        """How many steps from now are each exactly what Scheduler.schedule would make here:
        every running request one decode token, nothing admitted, no KV block to allocate
        or register, no cache op and no request finishing; 0 when the node is not so."""
        sched = self.scheduler
        if self.running is not None or sched.waiting or not sched.running:
            return 0
        if sched.speculator is not None or self.prefix.swa is not None or self.queue.ops:
            return 0
        if self.transfers:
            return 0
        if len(sched.running) > sched.max_num_batched_tokens:
            return 0
        block = self.kv.prefix_block
        steps = 1 << 62
        for req in sched.running:
            st = req.prefix
            c = req.num_computed
            if (
                req.status is not RequestStatus.RUNNING
                or req.num_inflight_steps
                or req.verifying
                or req.params.constraint is not None
                or c != req.seq_len - 1
                or len(req.output_ids) != req.num_sampled_scheduled
                or st.replay_until > c
                or st.pending_restore is not None
                or st.swa_marks
            ):
                return 0
            held = len(self.kv.tables[req.request_id][0]) * block
            steps = min(
                steps,
                (st.num_registered + 1) * block - c,  # the next full block is registered then
                held - c,  # then grows by a block
                req.params.max_tokens - len(req.output_ids) - 1,  # then finishes
            )
        return max(steps, 0)

    def run_steady(self, now: float, until: float, steps: int) -> float:
        """Take up to `steps` of the steps `steady_steps` counted, each ending before
        `until`, with the scheduler's and `finish_step`'s effect on the requests; the time
        the last one ended (`now` if none did)."""
        reqs = self.scheduler.running
        n = len(reqs)
        context = sum(r.num_computed for r in reqs)
        c = self.counters
        done = 0
        while done < steps:
            seconds = self.cost.decodes(n, context)
            draw = self.experts.draw(n, seconds) if self.experts is not None else None
            seconds = max(draw.seconds if draw is not None else seconds, MIN_STEP_S)
            end = now + seconds
            if end >= until:
                break
            if self.experts is not None and draw is not None:
                self.experts.take(draw)
            now = end
            context += n
            done += 1
            c.steps += 1
            c.busy_s += seconds
            c.decode_tokens += n
        if done:
            for req in reqs:
                req.num_computed += done
                req.num_sampled_scheduled += done
                req.output_ids.extend([OUTPUT_TOKEN] * done)
        return now

    def load(self) -> int:
        return self.unfinished

    def info(self) -> NodeInfo:
        """This node as a peer of the router: role, capacity and load (a heartbeat's)."""
        return NodeInfo(
            self.node_id,
            self.role,
            FINGERPRINT,
            f"http://{self.node_id}.sim",
            0,
            MODEL,
            {"kv_blocks": self.kv.num_blocks[0], "max_num_seqs": self.scheduler.max_num_seqs},
            {
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
                "kv_blocks_free": self.kv.pools[0].num_free,
            },
        )

    def cached_prefix(self, keys: list[bytes]) -> int:
        """Leading blocks of `keys` in this node's memory (device or host)."""
        n = 0
        while n < len(keys) and (
            keys[n] in self.kv.cached or (self.host is not None and keys[n] in self.host)
        ):
            n += 1
        return n


# every sampled token: an id outside the prompts' (trace.block_tokens) vocabulary, so that
# outputs never pass for a prompt's blocks
OUTPUT_TOKEN = -1

"""Continuous batching: a per-step token budget, chunked prefill mixed with decode,
priority/FCFS admission and preemption (free and recompute) when KV blocks run out. The
scheduler owns its KV manager and prefix cache, and asks for block-store reads in what it
returns; it calls nothing above it."""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from daemon.kv.manager import KVManager
from daemon.kv.prefix import PrefixCache
from daemon.kv.tier_ops import RestoreOp
from daemon.loop.request import FinishReason, Request, RequestStatus

log = structlog.get_logger(__name__)


@dataclass
class ScheduledSeq:
    request: Request
    start: int  # first position computed this step
    num_tokens: int
    samples: bool  # the step ends at the sequence's last scheduled token, so it samples
    sample_index: int  # which output token this sample is (seeds the per-request generator)
    replay: bool = False  # a bounded replay chunk: window limited to the replayed range
    restore: RestoreOp | None = None  # state to bring back before this step
    first: bool = False  # the request's first step since it was (re)admitted

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and self.start > 0 and self.samples


@dataclass
class StoreRead:
    """Prefix blocks to read from the block store before the request is admitted again."""

    request: Request
    keys: list[bytes]


@dataclass
class SchedulerStep:
    """What to run this step (`seqs` empty: nothing, only reads to start) and the block-store
    reads to start for requests taken out of the waiting queue. The caller must start every
    read in `store_reads`: those requests are LOADING, in neither queue, until the read's end
    adds them back (`Scheduler.add`)."""

    seqs: list[ScheduledSeq]  # decodes first, then prefill chunks
    store_reads: Sequence[StoreRead] = ()

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


class Scheduler:
    def __init__(
        self,
        kv: KVManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefix: PrefixCache | None = None,
    ) -> None:
        self.kv = kv
        self.prefix = prefix
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Request] = []  # sorted by Request.sort_key
        self.running: list[Request] = []
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        bisect.insort(self.waiting, req, key=lambda r: r.sort_key)

    def schedule(self) -> SchedulerStep | None:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        scheduled_ids: set[str] = set()
        preempted = False

        if self.prefix is not None:
            for req in self.running:
                self.prefix.register(req)
        for req in sorted(self.running, key=lambda r: r.sort_key):
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if req.params.constraint is not None and req.num_inflight_steps > 0:
                continue  # its grammar must see its last token before masking the next one
            n = min(self._tokens_to_compute(req), budget)
            if n == 0:
                continue
            while not self.kv.grow(req.request_id, req.num_computed + n):
                victim = self._pick_victim(exclude=scheduled_ids)
                self.preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            scheduled.append(self._commit(req, n))
            scheduled_ids.add(req.request_id)
            budget -= n

        # Admitting new work right after a preemption would only thrash.
        reads: list[StoreRead] = []
        if not preempted:
            budget = self._admit(budget, scheduled, reads)

        if not scheduled:
            return SchedulerStep([], reads) if reads else None
        scheduled.sort(key=lambda s: not s.is_decode)
        return SchedulerStep(scheduled, reads)

    def _admit(self, budget: int, scheduled: list[ScheduledSeq], reads: list[StoreRead]) -> int:
        """Admit waiting requests within `budget` into `scheduled`; those whose prefix must
        first be read from the block store go LOADING, their reads into `reads`."""
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[i]
            if req.num_inflight_steps > 0:
                i += 1  # preempted mid-flight: its last tokens are not on the host yet
                continue
            if self.prefix is not None and req.num_computed == 0:
                fetch = self.prefix.admit(req, first=req.stats.num_preemptions == 0)
                if fetch:
                    self.waiting.pop(i)
                    req.status = RequestStatus.LOADING
                    reads.append(StoreRead(req, fetch))
                    continue
            n = min(self._tokens_to_compute(req), budget)
            if not self.kv.grow(req.request_id, req.num_computed + n):
                self.kv.free(req.request_id)  # gives back any prefix it took
                req.num_computed = 0
                req.prefix.forget_blocks()
                req.prefix.pending_restore = None
                break
            self.waiting.pop(i)
            req.prefix.loaded = {}  # store payloads are on the device now (or not needed)
            if req.stats.scheduled_time is None:
                req.stats.scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            req.slot = self._free_slots.pop()
            self.running.append(req)
            seq = self._commit(req, n)
            seq.first = True
            scheduled.append(seq)
            budget -= n
        return budget

    def _tokens_to_compute(self, req: Request) -> int:
        if req.num_sampled_scheduled >= req.params.max_tokens:
            return 0  # its last token is asked for; only the output stage is left
        replay_until = req.prefix.replay_until
        if req.num_computed < replay_until:
            return replay_until - req.num_computed  # a replay chunk never runs past its end
        n = req.seq_len - req.num_computed
        return self.prefix.chunk_limit(req, n) if self.prefix is not None else n

    def _commit(self, req: Request, n: int) -> ScheduledSeq:
        start = req.num_computed
        req.num_computed += n
        samples = req.num_computed == req.seq_len
        st = req.prefix
        replay = start < st.replay_until
        seq = ScheduledSeq(
            req, start, n, samples, req.num_sampled_scheduled, replay, st.pending_restore
        )
        st.pending_restore = None
        if samples:
            req.num_sampled_scheduled += 1
        req.num_inflight_steps += 1
        return seq

    def _pick_victim(self, exclude: set[str]) -> Request:
        candidates = [
            r
            for r in self.running
            if r.status == RequestStatus.RUNNING and r.request_id not in exclude
        ]
        return max(candidates, key=lambda r: r.sort_key)

    def _release(self, req: Request, final: bool = False) -> None:
        if self.prefix is not None:
            self.prefix.leave(req, final)
        self.kv.free(req.request_id)
        if req.slot >= 0:
            self._free_slots.append(req.slot)
            req.slot = -1

    def preempt(self, req: Request) -> None:
        """Free everything the request holds; it recomputes from its known tokens later."""
        self._release(req)
        self.running.remove(req)
        req.num_computed = 0
        req.prefix.forget_blocks()
        req.stats.num_preemptions += 1
        self.num_preemptions += 1
        log.debug("preempt", request_id=req.request_id, tokens=req.seq_len)
        self.add(req)

    def finish(self, req: Request, reason: FinishReason) -> None:
        if req.status == RequestStatus.FINISHED:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        self._release(req, final=True)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

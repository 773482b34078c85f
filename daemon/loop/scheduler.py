"""Continuous batching: a per-step token budget, chunked prefill mixed with decode,
priority/FCFS admission and preemption (free and recompute) when KV blocks run out, and with
a Speculator, draft tokens verified in the same step as the decodes they follow. The
scheduler owns its KV manager and prefix cache, and asks for block-store reads in what it
returns; it calls nothing above it."""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import structlog

from daemon.kv.manager import KVManager
from daemon.kv.prefix import PrefixCache
from daemon.kv.tier_ops import RestoreOp
from daemon.loop.request import FinishReason, Request, RequestStatus
from daemon.loop.spec.base import OVERLAP_MIN_SHARE, Draft
from daemon.loop.spec.device_drafter import DeviceDrafter
from daemon.loop.spec.speculator import Speculator

log = structlog.get_logger(__name__)

# with overlap, a request whose drafts went unverified this many decodes in a row is held back
# once (its last token known on the host) to be drafted again; then after twice as many, ...
PROBE_EVERY = 8
PROBE_MAX = 64  # the longest a request goes between probes: load falls, drafts may pay again


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
    # draft tokens verified this step: the last len(draft) of its num_tokens positions; it
    # samples at each of its last len(draft) + 1 rows
    draft: list[int] = field(default_factory=list)
    proposal: Draft | None = None  # the draft as the drafter proposed it (with `draft`)
    # layer skipping: drafts the runner makes at the end of the step, after the token it
    # samples (its KV blocks cover their positions)
    draft_after: int = 0

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and self.start > 0 and self.samples

    @property
    def order(self) -> int:
        """Row order in the step: decodes, then verifies (decodes with drafts), then chunks."""
        return 0 if self.is_decode else 1 if self.draft else 2


@dataclass
class StoreRead:
    """Prefix blocks to read from the block store before the request is admitted again."""

    request: Request
    keys: list[bytes]


def decode_context(seqs: list[ScheduledSeq]) -> float | None:
    """The positions the decode and verify rows of a step attend, on average (None: it has
    none): what the speculative step cost prices a row's attention by."""
    starts = [s.start for s in seqs if s.is_decode or s.draft]
    return sum(starts) / len(starts) if starts else None


@dataclass
class SchedulerStep:
    """What to run this step (`seqs` empty: nothing, only reads to start) and the block-store
    reads to start for requests taken out of the waiting queue. The caller must start every
    read in `store_reads`: those requests are LOADING, in neither queue, until the read's end
    adds them back (`Scheduler.add`)."""

    seqs: list[ScheduledSeq]  # decodes first, then verifies, then prefill chunks
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
        speculator: Speculator | None = None,
    ) -> None:
        """`speculator`: drafts for the decodes and their verify lengths (None: off)."""
        self.kv = kv
        self.prefix = prefix
        self.speculator = speculator
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

    def schedule(self, overlapped: bool = False) -> SchedulerStep | None:
        """The next step; `overlapped`: one is in flight, and a thin step (`_thin`) waits for
        it (None)."""
        if overlapped and self._thin():
            return None
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
            if _waits_on_its_step(req) or self._held_for_drafts(req):
                continue
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
        if self.speculator is not None and budget > 0:
            self._draft(self.speculator, scheduled, budget)
        if self.speculator is not None and isinstance(self.speculator.drafter, DeviceDrafter):
            self._mark_drafting(self.speculator.k, scheduled)
        scheduled.sort(key=lambda s: s.order)
        return SchedulerStep(scheduled, reads)

    def _draft(self, spec: Speculator, scheduled: list[ScheduledSeq], budget: int) -> None:
        """Extend the step's decodes that may speculate by the drafts the policy chooses,
        within `budget` tokens and the KV memory free now (drafts preempt nobody). A request
        whose draft the policy declined proposes again only at the decodes `_takes_drafts`
        names (counted from the decline), or at once in a step lighter than the one that
        declined it: proposing costs the loop's thread every step, and a policy that declines
        at this load (chat at 64 sequences) declines again, but not where the load has fallen
        (the wave's prefill done, the batch thinned to its last few requests)."""
        tokens = sum(s.num_tokens for s in scheduled)
        seqs = []
        for s in scheduled:
            if not self._may_speculate(s):
                continue
            req = s.request
            if (
                req.declined_decodes
                and not _takes_drafts(req.declined_decodes)
                and tokens >= req.declined_load
            ):
                req.declined_decodes += 1
                continue
            seqs.append(s)
        if not seqs:
            return
        # a decode scheduled now has counted its sample: what is left after it
        limits = [
            (s.request, s.request.params.max_tokens - s.request.num_sampled_scheduled) for s in seqs
        ]
        plans = spec.plan(limits, len(scheduled), tokens, decode_context(scheduled))
        chosen = 0
        for seq, plan in zip(seqs, plans):
            n = min(plan.length, budget)
            req = seq.request
            if n <= 0 or not self.kv.grow(req.request_id, req.num_computed + n):
                req.decodes_without_drafts += 1
                if req.declined_decodes or (plan.proposal.tokens and plan.length == 0):
                    req.declined_decodes += 1
                    req.declined_load = tokens
                continue
            req.decodes_without_drafts = req.declined_decodes = 0
            seq.draft, seq.proposal = plan.tokens[:n], plan.proposal
            seq.num_tokens += n
            req.num_computed += n
            req.verifying = True
            budget -= n
            chosen += n
        spec.stats.on_budget(chosen)

    def _mark_drafting(self, k: int, scheduled: list[ScheduledSeq]) -> None:
        """Layer skipping: mark the sequences the runner drafts for at the end of this step,
        those whose next decode takes drafts (`_takes_drafts`: under overlap it is then held
        back for them), and grow their KV over the draft positions (the passes write the draft
        layers' KV there; the verify overwrites it at every layer). A sequence not marked gives
        back what an earlier mark left it beyond its computed positions."""
        for seq in scheduled:
            req = seq.request
            n = 0
            takes = _takes_drafts(req.decodes_without_drafts)
            if takes and seq.samples and not seq.replay:
                # the next step samples one token: drafts for those after it
                n = max(0, min(k, req.params.max_tokens - req.num_sampled_scheduled - 1))
            if n > 0 and not self.kv.grow(req.request_id, req.num_computed + n):
                n = 0
            seq.draft_after = n
            if n == 0:
                self.kv.shrink(req.request_id, req.num_computed)

    def _thin(self) -> bool:
        """Speculating, with nothing waiting: fewer than OVERLAP_MIN_SHARE of the running
        requests could run now."""
        if self.speculator is None or self.waiting or not self.running:
            return False
        ready = sum(
            1
            for req in self.running
            if req.status == RequestStatus.RUNNING
            and not _waits_on_its_step(req)
            and not (self._may_hold(req) and self._wants_drafts(req))
        )
        return ready < OVERLAP_MIN_SHARE * len(self.running)

    def _held_for_drafts(self, req: Request) -> bool:
        """With overlap: a decode whose last token is still on the device cannot be drafted
        for; it is held back for a step (its token then known) while its drafts have been
        worth verifying, and once they have not, after PROBE_EVERY decodes without, twice as
        many, and so on (each hold costs it a step): `_wants_drafts`."""
        if not self._may_hold(req):
            return False
        if self._wants_drafts(req):
            return True
        req.decodes_without_drafts += 1
        return False

    def _wants_drafts(self, req: Request) -> bool:
        """Whether a decode whose last token is in flight is held back for drafts: at the
        decodes `_takes_drafts` names, and with a drafter on the host only where the policy
        would verify drafts from its known tokens (`Speculator.worth_holding`): a hold that
        verifies nothing costs the request a step, and under a policy that declines most
        drafts (chat at high concurrency) nearly every hold was such. Decided once per
        position (`_thin` asks first)."""
        spec = self.speculator
        if spec is None or not _takes_drafts(req.decodes_without_drafts):
            return False
        if isinstance(spec.drafter, DeviceDrafter):  # its drafts are made on the device
            return True
        at = req.num_known_tokens
        if req.hold_check is None or req.hold_check[0] != at:
            limit = req.params.max_tokens - req.num_sampled_scheduled - 1  # after its next
            req.hold_check = (at, spec.worth_holding(req, limit, len(self.running)))
        return req.hold_check[1]

    def _may_hold(self, req: Request) -> bool:
        """A speculating decode whose last token is still in flight, with a draft possible
        after it."""
        return (
            self.speculator is not None
            and req.num_known_tokens != req.seq_len
            and req.num_computed == req.seq_len - 1
            # else no draft could follow its next token
            and req.params.max_tokens - req.num_sampled_scheduled >= 2
        )

    @staticmethod
    def _may_speculate(seq: ScheduledSeq) -> bool:
        """A decode whose input is the request's last known token (no step of it in flight),
        with tokens left after this one. A grammar masks its verify rows along the draft (and
        cuts it where it disallows a token), penalties count it row by row (ModelRunner)."""
        req = seq.request
        return (
            seq.is_decode
            and not seq.first
            and seq.restore is None
            and not seq.replay
            and req.num_known_tokens == seq.start + 1
            and req.num_sampled_scheduled < req.params.max_tokens
        )

    def verified(self, seq: ScheduledSeq, accepted: int, state_at: int | None) -> None:
        """The outcome of a verify step: `accepted` of its drafts taken, plus one token;
        `state_at`: the position the request's per-request state was rolled back to (it
        recomputes from there), None where nothing was rolled back. The request then holds
        the KV blocks of what it has computed, no more."""
        req = seq.request
        req.verifying = False
        req.num_sampled_scheduled += accepted
        if req.status != RequestStatus.RUNNING:
            return  # finished or preempted meanwhile: it holds no blocks
        kept = seq.start + seq.num_tokens - len(seq.draft) + accepted
        req.num_computed = kept if state_at is None else min(state_at, kept)
        self.kv.shrink(req.request_id, req.num_computed)

    def _admit(self, budget: int, scheduled: list[ScheduledSeq], reads: list[StoreRead]) -> int:
        """Admit waiting requests within `budget` into `scheduled`; those whose prefix must
        first be read from the block store go LOADING, their reads into `reads`."""
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[i]
            if req.num_inflight_steps > 0:
                i += 1  # preempted mid-flight: its last tokens are not on the host yet
                continue
            if req.images_until is not None and req.images_until <= req.num_computed:
                i += 1  # nothing to compute before its images' embeddings come
                continue
            if self.prefix is not None and req.num_computed == 0:
                fetch = self.prefix.admit(req, first=req.stats.num_preemptions == 0)
                if fetch:
                    self.waiting.pop(i)
                    req.status = RequestStatus.LOADING
                    reads.append(StoreRead(req, fetch))
                    continue
            n = min(self._tokens_to_compute(req), budget)
            if n == 0 or not self.kv.grow(req.request_id, req.num_computed + n):
                self.kv.free(req.request_id)  # gives back any prefix it took
                req.num_computed = 0
                req.prefix.forget_blocks()
                req.prefix.pending_restore = None
                if n == 0:  # its text is cached up to its images: it waits for them unadmitted
                    req.images_until = 0
                    i += 1
                    continue
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
        if req.images_until is not None:  # its images' embeddings are not here yet
            n = min(n, max(req.images_until - req.num_computed, 0))
        return self.prefix.chunk_limit(req, n) if self.prefix is not None and n else n

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

    def park(self, req: Request) -> None:
        """Take a running request with nothing left to compute out of the running batch, its
        blocks kept (a KV export reads them), out of reach of preemption; `finish` frees them."""
        self.running.remove(req)
        req.status = RequestStatus.LOADING
        if req.slot >= 0:
            self._free_slots.append(req.slot)
            req.slot = -1

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


def _waits_on_its_step(req: Request) -> bool:
    """A request that cannot join a step while its last one is in flight: its grammar must see
    its last token before masking the next, or its length is known only once its verify step
    is processed."""
    return req.verifying or (req.params.constraint is not None and req.num_inflight_steps > 0)


def _takes_drafts(decodes_without_drafts: int) -> bool:
    """Whether a request that many decodes without verified drafts takes drafts at its next
    decode: while they are verified, then after PROBE_EVERY decodes without, twice as many,
    and so on up to every PROBE_MAX decodes (the decodes `_held_for_drafts` holds back for
    them under overlap, and those at which `_draft` asks again after a decline)."""
    n = decodes_without_drafts
    return n == 0 or (n >= PROBE_EVERY and (n & (n - 1) == 0 or n % PROBE_MAX == 0))

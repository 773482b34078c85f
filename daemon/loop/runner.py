"""Model runner: turns a scheduled step into device tensors (host side) and runs
forward + sampling (device side, off the event loop).

Tokens sampled in step N are written to `last_tokens[slot]` on the device; a
decode in step N+1 whose input the host has not seen yet carries -1 and reads
it from there, so step N+1 never waits for step N's output on the host.

A sequence with drafts (speculative decoding) has logits at each of its last len(draft) + 1
rows; `rejection.verify` takes what the target agrees with. A model whose whole state is in
paged blocks (dense) gets those rows as one-token decodes (a row attends to the positions up
to its own, whose KV the step writes first), batched with the others; a cache with
per-request state (DeepSeek-V4) is snapshotted before the forward and restored after a
rejection, and the request recomputes from the snapshot's position. A grammar masks each
verify row along the draft (cut, before the forward, at the first token it disallows);
penalties count, at each verify row, the drafts before it; logit bias applies to every row.

With a draft network (`draft_network`: layer skipping, a separate draft model), it sees every
step's rows after the target's forward (`DraftNetwork.mirror`), and the sequences the scheduler
marks draft at the end of the step, on this thread (loop/early_exit.py); their drafts travel
back in the StepResult.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, cast

import torch

from daemon.kv.block_copy import BlockCopier
from daemon.kv.manager import KVManager
from daemon.kv.spec import KVGroup, SlidingWindowSpec
from daemon.kv.tier_ops import CacheOps, RestoreOp
from daemon.loop.constraint import Constraint, allocate_bitmask, apply_bitmask
from daemon.loop.early_exit import Drafted, DraftNetwork, DraftRows, draft_passes
from daemon.loop.request import SamplingParams, TokenLogprob
from daemon.loop.sampler import (
    PenaltyState,
    SampleResult,
    SamplingBatch,
    TargetLogprobs,
    add_logprobs,
    apply_logit_bias,
    apply_penalties,
    sample,
    target_logprobs,
)
from daemon.loop.scheduler import ScheduledSeq, SchedulerStep
from daemon.loop.spec.device_drafter import EarlyDraft
from daemon.loop.spec.rejection import verify
from daemon.loop.transfer import KVTransfer
from daemon.models.base import (
    AttentionMetadata,
    DecodeGraphs,
    Model,
    ModelCache,
    RequestState,
    SeqSlice,
    SlidingWindowCache,
    VisionLanguageModel,
)

PROMPT_LOGITS_ROWS = 256  # prompt logprobs: rows of full-vocabulary logits held at once
GRAPH_DEVICES = ("cuda", "cpu")  # device types whose models are asked for decode graphs


@dataclass
class PromptSpan:
    """Prompt positions of one sequence whose logprobs this step computes."""

    seq_index: int  # in the step
    first: int  # the first prompt position scored (its logits come from the row before)
    count: int
    top_n: int


@dataclass
class VerifyRows:
    """The sequences of a step that verify drafts."""

    seqs: list[int]  # their index among the step's sampling sequences
    rows: torch.Tensor  # [R] rows of the step's logits: len(draft) + 1 per sequence, in order
    drafts: list[list[int]]
    draft_probs: list[torch.Tensor | None]
    sampling: SamplingBatch  # one row per sequence
    slots: torch.Tensor  # [N] their slots (last_tokens)
    # per sequence: its block tables and the position its state is snapshotted at
    states: list[tuple[list[list[int]], int]]
    penalized: list[int] = field(default_factory=list)  # the sequences with penalties
    # the first of `rows` where they are one run (they follow the decodes' rows): the
    # verify reads a view of the logits instead of copying them; None otherwise
    run_start: int | None = None


class _VerifyBuilder:
    """Collects a step's sequences with drafts while it is prepared."""

    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.rows: list[int] = []
        self.drafts: list[list[int]] = []
        self.draft_probs: list[torch.Tensor | None] = []
        self.params: list[SamplingParams] = []
        self.indices: list[int] = []
        self.slots: list[int] = []
        self.states: list[tuple[list[list[int]], int]] = []
        self.penalized: list[int] = []

    def add(self, sample: int, rows: range, seq: ScheduledSeq, tables: list[list[int]]) -> None:
        req = seq.request
        self.seqs.append(sample)
        self.rows.extend(rows)
        self.drafts.append(list(seq.draft))
        self.draft_probs.append(None)
        self.params.append(req.params)
        self.indices.append(seq.sample_index)
        self.slots.append(req.slot)
        self.states.append((tables, seq.start))
        if req.params.has_penalties:
            self.penalized.append(len(self.seqs) - 1)

    def build(self, vocab: int) -> VerifyRows | None:
        if not self.seqs:
            return None
        return VerifyRows(
            seqs=self.seqs,
            rows=torch.tensor(self.rows, dtype=torch.long),
            drafts=self.drafts,
            draft_probs=self.draft_probs,
            sampling=SamplingBatch.build(self.params, self.indices, vocab),
            slots=torch.tensor(self.slots, dtype=torch.long),
            states=self.states,
            penalized=self.penalized,
            run_start=self.rows[0] if self.rows[-1] - self.rows[0] + 1 == len(self.rows) else None,
        )


class _Masks:
    """A step's grammar masks while it is prepared: a bitmask over at most `rows` logits rows,
    allocated once a constrained row needs it, and the rows written."""

    def __init__(self, rows: int, vocab: int) -> None:
        self.num_rows, self.vocab = rows, vocab
        self.bitmask: torch.Tensor | None = None
        self.rows: list[int] = []

    def _mask(self) -> torch.Tensor:
        if self.bitmask is None:
            self.bitmask = allocate_bitmask(self.num_rows, self.vocab)
        return self.bitmask

    def fill(self, constraint: Constraint, row: int) -> None:
        if constraint.fill(self._mask(), row):
            self.rows.append(row)

    def fill_draft(self, constraint: Constraint, row: int, draft: list[int]) -> int:
        """Rows `row`.. along the draft; how many of its tokens the grammar allows."""
        allowed, rows = constraint.fill_draft(self._mask(), row, draft)
        self.rows.extend(rows)
        return allowed

    def taken(self, num_rows: int) -> tuple[torch.Tensor | None, list[int]]:
        """The bitmask over the step's `num_rows` logits rows (None: no row constrained)."""
        if self.bitmask is None or not self.rows:
            return None, []
        return self.bitmask[:num_rows], self.rows


@dataclass
class PreparedStep:
    input_ids: torch.Tensor  # [T], -1 where the token is on the device only
    placeholder_rows: torch.Tensor  # rows of input_ids to fill from last_tokens
    placeholder_slots: torch.Tensor  # slots they read
    positions: torch.Tensor  # [T]
    attention: AttentionMetadata  # the model's own, built by its cache
    logits_rows: torch.Tensor  # [L] forward rows whose logits are computed
    # [S] the logits row of each sampling sequence without drafts
    sample_rows: torch.Tensor | None
    sample_slots: torch.Tensor  # [S]
    sampling: SamplingBatch | None
    new_penalty_states: list[tuple[int, list[int], list[int]]]  # (slot, prompt, outputs)
    penalty_rows: list[int]  # logits rows
    penalty_slots: list[int]
    penalty_params: list[SamplingParams]
    bitmask: torch.Tensor | None  # [L, ceil(V/32)] int32 grammar masks (constrained rows only)
    bitmask_rows: list[int]
    # logit_bias entries: the logits row, token id and bias of each (None: no row has any)
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    prompt_rows: torch.Tensor | None  # [R] forward rows whose next prompt token is scored
    prompt_targets: torch.Tensor | None  # [R] that token
    prompt_spans: list[PromptSpan]
    cache_ops: CacheOps  # tier moves and sliding-window saves, before anything reuses a block
    restores: list[tuple[RestoreOp, list[list[int]]]]  # with the request's block tables
    verify: VerifyRows | None = None  # sequences with drafts (None: none)
    num_samples: int = 0  # sampling sequences, with drafts or not
    drafting: DraftRows | None = None  # sequences that draft at the end (a draft network)
    # KV handoff imports and exports, after the cache ops (the engine adds them)
    transfers: list[KVTransfer] = field(default_factory=list)
    # image embeddings: the batch rows they replace and their rows (None: no image this step)
    splice: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class Verified:
    """What the verify rows of a step gave, per sequence with drafts."""

    tokens: list[list[int]]  # accepted drafts, then one more token
    rolled_back: list[int | None]  # the position its state was restored to, if it was
    logprobs: SampleResult | None  # flat over `tokens` (device tensors), when asked for


@dataclass
class StepResult:
    tokens: list[int]  # one per sampling sequence, in step order
    logprobs: list[TokenLogprob | None]
    # (seq index in the step, first prompt position, its entries) per PromptSpan
    prompt_logprobs: list[tuple[int, int, list[TokenLogprob]]] = field(default_factory=list)
    # per sampling sequence (empty: no sequence had drafts): the accepted drafts before its
    # token, their logprobs (where asked for), and where its per-request state was rolled back
    # to (None: not rolled back)
    accepted: list[list[int]] = field(default_factory=list)
    accepted_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    rolled_back: list[int | None] = field(default_factory=list)
    # per sampling sequence (empty: none drafted): the drafts made after its token on the
    # device (a draft network), None for a sequence that made none
    drafts: list[EarlyDraft | None] = field(default_factory=list)
    seconds: float = 0.0  # the device thread's time in `execute`


class ModelRunner:
    def __init__(
        self,
        model: Model,
        kv_groups: list[KVGroup],
        num_blocks: list[int],
        device: torch.device,
        max_num_seqs: int,
        seed: int = 0,
        cpu_threads: int = 0,
        decode_graphs: bool = False,
        after_forward: Callable[[], None] | None = None,
        spec_tokens: int = 0,
        draft_network: Callable[[ModelCache], DraftNetwork] | None = None,
    ) -> None:
        """`decode_graphs`: ask the model for its decode graphs (CUDA graphs on cuda, a
        compiled forward on a CPU; a model may have none). `after_forward`: called on the
        device thread after each forward (the MoE load statistics). `spec_tokens`: the most
        drafts a request verifies in a step (0: no speculative decoding). `draft_network`: makes
        the network the marked sequences draft through over the target's cache, once this has
        allocated it (None: the runner does not draft)."""
        self.model = model
        self.device = device
        # draft rows as one-token decodes: only where a request's whole state is paged
        self.drafts_as_decodes = not any(g.spec.per_request for g in kv_groups)
        # decode steps by graph replay (or compiled); the cache pads them to the graphs' shapes
        rows = max_num_seqs * (1 + spec_tokens) if self.drafts_as_decodes else max_num_seqs
        graph_batch = rows if decode_graphs and device.type in GRAPH_DEVICES else 0
        self.cache: ModelCache = model.allocate_cache(kv_groups, num_blocks, device, graph_batch)
        self.graphs: DecodeGraphs | None = (
            model.decode_graphs(self.cache, device, graph_batch) if graph_batch else None
        )
        if graph_batch and self.graphs is None:  # none on this device: a cache that pads nothing
            del self.cache
            self.cache = model.allocate_cache(kv_groups, num_blocks, device, 0)
        self.drafting: DraftNetwork | None = draft_network(self.cache) if draft_network else None
        # the same cache where the model has a sliding window: only then does the prefix cache
        # make window saves and restores
        self.window: SlidingWindowCache | None = (
            cast(SlidingWindowCache, self.cache)
            if any(isinstance(g.spec, SlidingWindowSpec) for g in kv_groups)
            else None
        )
        paged = [i for i, g in enumerate(kv_groups) if not g.spec.per_request]
        self.copier = BlockCopier([self.cache.block_views(i) for i in paged]) if paged else None
        self.vocab_size = model.vocab_size
        self.last_tokens = torch.zeros(max_num_seqs, dtype=torch.long, device=device)
        self.penalties: dict[int, PenaltyState] = {}
        self.drafts_cut = 0  # draft tokens grammars disallowed, cut before their verify
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        # On a CPU "device" the forward shares the cores with the event loop, which does its
        # overlapped work meanwhile; each worker thread keeps its own OpenMP thread count.
        self.cpu_threads = cpu_threads if device.type == "cpu" else 0
        self.device_module = torch.get_device_module(device) if device.type != "cpu" else None
        self.stream = self.device_module.Stream(device) if self.device_module else None
        # the engine waits for a step's launch before its loop work: only worth it where the
        # launch returns before the device is done
        self.signals_launch = self.stream is not None
        self.after_forward = after_forward

    def warm_up(self) -> None:
        """Make the decode graphs of the common shapes now (at engine start), not on the first
        steps that need them."""
        if self.graphs is None:
            return
        # with the device thread's thread count: compiled CPU kernels keep the one they saw
        previous = torch.get_num_threads()
        if self.cpu_threads:
            torch.set_num_threads(self.cpu_threads)
        try:
            self.graphs.warm_up()
        finally:
            torch.set_num_threads(previous)

    # ---- host side (event loop thread) ---------------------------------------------------

    def prepare(self, step: SchedulerStep, kv: KVManager, cache_ops: CacheOps) -> PreparedStep:
        input_ids: list[int] = []
        positions: list[int] = []
        placeholder_rows: list[int] = []
        placeholder_slots: list[int] = []
        slices: list[SeqSlice] = []
        logits_rows: list[int] = []
        sample_rows: list[int] = []
        sample_slots: list[int] = []
        sample_params: list[SamplingParams] = []
        sample_indices: list[int] = []
        new_penalty_states = []
        penalty_rows: list[int] = []
        penalty_slots: list[int] = []
        penalty_params: list[SamplingParams] = []
        restores: list[tuple[RestoreOp, list[list[int]]]] = []
        masks = _Masks(sum(len(s.draft) + 1 for s in step.seqs if s.samples), self.vocab_size)
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        prompt_rows: list[int] = []
        prompt_targets: list[int] = []
        prompt_spans: list[PromptSpan] = []
        verify = _VerifyBuilder()
        drafting = DraftRows()
        num_samples = 0
        splice_rows: list[int] = []
        splice_embeds: list[torch.Tensor] = []

        for i, seq in enumerate(step.seqs):
            req = seq.request
            if seq.draft and req.params.constraint is not None:
                self._walk_draft(seq, req.params.constraint, masks, len(logits_rows))
            start, n = seq.start, seq.num_tokens
            end = start + n
            d = len(seq.draft)
            q_start = len(input_ids)
            known = min(end - d, req.num_known_tokens)
            if start < known:
                input_ids.extend(
                    req.prompt_ids[start:known]
                    if known <= req.num_prompt_tokens
                    else [req.token_at(p) for p in range(start, known)]
                )
            for _ in range(max(known, start), end - d):
                placeholder_rows.append(len(input_ids))
                placeholder_slots.append(req.slot)
                input_ids.append(-1)
            input_ids.extend(seq.draft)
            positions.extend(range(start, end))
            for image in req.images:  # its placeholders computed in this step
                lo, hi = max(start, image.start), min(known, image.end)
                if lo < hi:
                    splice_rows.extend(range(q_start + lo - start, q_start + hi - start))
                    splice_embeds.append(image.embeds[lo - image.start : hi - image.start])
            tables = kv.block_tables(req.request_id)
            floor = req.prefix.replay_from if seq.replay else 0
            if d and self.drafts_as_decodes:
                slices.extend(SeqSlice(q_start + j, start + j, 1, tables, True) for j in range(n))
            else:
                slices.append(SeqSlice(q_start, start, n, tables, seq.is_decode, seq.replay, floor))
            if seq.restore is not None:
                restores.append((seq.restore, [list(t) for t in tables]))
            # prompt logprobs, once (a recompute after the first sample has them already)
            last = min(end, req.num_prompt_tokens - 1)
            if req.params.prompt_logprobs is not None and seq.sample_index == 0 and start < last:
                prompt_spans.append(
                    PromptSpan(i, start + 1, last - start, req.params.prompt_logprobs)
                )
                prompt_rows.extend(range(q_start, q_start + last - start))
                prompt_targets.extend(req.prompt_ids[start + 1 : last + 1])
            if seq.first and req.params.has_penalties:
                new_penalty_states.append((req.slot, list(req.prompt_ids), list(req.output_ids)))
            if not seq.samples:
                continue
            rows = range(len(logits_rows), len(logits_rows) + d + 1)
            logits_rows.extend(range(len(input_ids) - d - 1, len(input_ids)))
            if bias := req.params.logit_bias:
                for row in rows:
                    bias_rows.extend([row] * len(bias))
                    bias_ids.extend(bias.keys())
                    bias_values.extend(bias.values())
            if seq.draft_after:
                drafting.add(
                    num_samples,
                    req.slot,
                    seq.draft_after,
                    end - d,
                    len(verify.seqs) if d else None,
                    [list(t) for t in tables],
                    req.params,
                    seq.sample_index + 1,
                    rows.start,
                )
            if d or seq.proposal is not None:  # a draft the grammar cut whole still verifies
                probs = seq.proposal.probs if seq.proposal is not None else None
                verify.add(num_samples, rows, seq, [list(t) for t in tables])
                verify.draft_probs[-1] = probs[:d] if probs is not None else None
                num_samples += 1
                continue
            num_samples += 1
            if req.params.has_penalties:
                penalty_rows.append(rows[0])
                penalty_slots.append(req.slot)
                penalty_params.append(req.params)
            if req.params.constraint is not None:
                masks.fill(req.params.constraint, rows[0])
            sample_rows.append(rows[0])
            sample_slots.append(req.slot)
            sample_params.append(req.params)
            sample_indices.append(seq.sample_index)

        bitmask, bitmask_rows = masks.taken(len(logits_rows))
        return PreparedStep(
            input_ids=torch.tensor(input_ids, dtype=torch.long),
            placeholder_rows=torch.tensor(placeholder_rows, dtype=torch.long),
            placeholder_slots=torch.tensor(placeholder_slots, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            attention=self.cache.build_attention(slices),
            logits_rows=torch.tensor(logits_rows, dtype=torch.long),
            # every row samples (no drafts): the logits are the sampled rows already
            sample_rows=torch.tensor(sample_rows, dtype=torch.long)
            if len(sample_rows) != len(logits_rows)
            else None,
            sample_slots=torch.tensor(sample_slots, dtype=torch.long),
            sampling=SamplingBatch.build(sample_params, sample_indices, self.vocab_size)
            if sample_params
            else None,
            new_penalty_states=new_penalty_states,
            penalty_rows=penalty_rows,
            penalty_slots=penalty_slots,
            penalty_params=penalty_params,
            bitmask=bitmask,
            bitmask_rows=bitmask_rows,
            logit_bias=(
                torch.tensor(bias_rows, dtype=torch.long),
                torch.tensor(bias_ids, dtype=torch.long),
                torch.tensor(bias_values, dtype=torch.float32),
            )
            if bias_rows
            else None,
            prompt_rows=torch.tensor(prompt_rows, dtype=torch.long) if prompt_spans else None,
            prompt_targets=torch.tensor(prompt_targets, dtype=torch.long) if prompt_spans else None,
            prompt_spans=prompt_spans,
            cache_ops=cache_ops,
            restores=restores,
            verify=verify.build(self.vocab_size),
            num_samples=num_samples,
            drafting=drafting if drafting.slots and self.drafting is not None else None,
            splice=(torch.tensor(splice_rows, dtype=torch.long), torch.cat(splice_embeds))
            if splice_rows
            else None,
        )

    def _walk_draft(
        self, seq: ScheduledSeq, constraint: Constraint, masks: _Masks, row: int
    ) -> None:
        """Masks the verify rows of a constrained sequence (from logits row `row`) along its
        draft and cuts the draft at the first token the grammar disallows. The scheduler grew
        its KV for the whole draft: `Scheduler.verified` gives back what lies past the cut."""
        allowed = masks.fill_draft(constraint, row, seq.draft)
        cut = len(seq.draft) - allowed
        if cut:
            seq.draft = seq.draft[:allowed]
            seq.num_tokens -= cut
            seq.request.num_computed -= cut
            self.drafts_cut += cut

    # ---- device side (worker thread) -------------------------------------------------------

    def execute_cache_ops(self, ops: CacheOps, transfers: list[KVTransfer] | None = None) -> None:
        """Cache ops (and KV transfers) with no step to ride on (the engine is idle)."""
        if self.stream is None:
            self.run_cache_ops(ops)
            self.run_transfers(transfers or [])
            return
        with self.device_module.stream(self.stream):
            self.run_cache_ops(ops)
            self.run_transfers(transfers or [])

    @torch.inference_mode()
    def run_transfers(self, transfers: list[KVTransfer]) -> None:
        """Handoff imports and exports, each failing on its own (its error kept in it)."""
        for transfer in transfers:
            transfer.run(self.cache)

    @torch.inference_mode()
    def run_cache_ops(self, ops: CacheOps) -> None:
        """Block saves first (a block saved may be the target of a load), then loads, then
        sliding-window snapshots (only a sliding-window model's prefix cache makes those)."""
        if ops.block_saves:
            payloads = self.copier.gather([s.blocks for s in ops.block_saves])
            for save, payload in zip(ops.block_saves, payloads):
                save.entry.payload = payload
        if ops.block_loads:
            self.copier.scatter(
                [load.blocks for load in ops.block_loads],
                [load.entry.payload for load in ops.block_loads],
            )
        if ops.swa_saves:
            window = self.window
            assert window is not None
            for save in ops.swa_saves:
                save.snapshot.tensor = window.save_swa(save.swa_block, save.position)

    @torch.inference_mode()
    def execute(self, step: PreparedStep, launched: Callable[[], None] | None = None) -> StepResult:
        """Run one step; `launched` is called once all of its work is queued on the device,
        before this thread blocks on it (on a CPU: once it is done). Timed: `seconds`."""
        started = time.perf_counter()
        result = self._step(step, launched)
        result.seconds = time.perf_counter() - started
        return result

    def _step(self, step: PreparedStep, launched: Callable[[], None] | None) -> StepResult:
        if self.stream is None:
            result, prompt, verified, drafted = self._execute(step)
            if launched is not None:
                launched()
            return self._to_host(result, prompt, verified, step, drafted)
        # Accelerators: launch on our stream, copy the few result values to the
        # host asynchronously and block this worker thread (not the event loop) on an event.
        with self.device_module.stream(self.stream):
            result, prompt, verified, drafted = self._execute(step)
            result, prompt = _to_cpu(result), _to_cpu(prompt)
            if verified is not None:
                verified.logprobs = _to_cpu(verified.logprobs)
            if drafted is not None:
                drafted.to_host_async()
            if result is not None or prompt is not None or verified is not None:
                done = self.device_module.Event()
                done.record(self.stream)
        if launched is not None:
            launched()
        if result is None and prompt is None and verified is None:
            return StepResult([], [])
        done.synchronize()
        return self._to_host(result, prompt, verified, step, drafted)

    def _execute(
        self, step: PreparedStep
    ) -> tuple[SampleResult | None, TargetLogprobs | None, Verified | None, Drafted | None]:
        dev = self.device
        if self.cpu_threads and torch.get_num_threads() != self.cpu_threads:
            torch.set_num_threads(self.cpu_threads)
        self.run_cache_ops(step.cache_ops)
        if step.transfers:
            self.run_transfers(step.transfers)
        if step.restores:  # as swa_saves, only for a sliding-window model
            window = self.window
            assert window is not None
            for restore, tables in step.restores:
                window.restore(restore, tables)
        vr = step.verify
        # before the forward writes the drafts' state (empty where all of it is paged)
        snapshots = [self.cache.snapshot(t, p) for t, p in vr.states] if vr is not None else []
        input_ids = step.input_ids.to(dev, non_blocking=True)
        if step.placeholder_rows.numel():
            rows = step.placeholder_rows.to(dev, non_blocking=True)
            input_ids[rows] = self.last_tokens[step.placeholder_slots.to(dev, non_blocking=True)]
        positions, attention = step.positions.to(dev, non_blocking=True), step.attention.to(dev)
        if step.splice is not None:  # a prefill with images: never a decode graph
            rows, embeds = (t.to(dev, non_blocking=True) for t in step.splice)
            vision = cast(VisionLanguageModel, self.model)
            hidden = vision.forward_spliced(
                input_ids, positions, attention, self.cache, rows, embeds
            )
        else:
            hidden = self.graphs.run(input_ids, positions, attention) if self.graphs else None
        if hidden is None:
            hidden = self.model(input_ids, positions, attention, self.cache)
        if self.drafting is not None:
            self.drafting.mirror(input_ids, positions, attention, hidden[: input_ids.shape[0]])
        if self.after_forward is not None:
            self.after_forward()
        for slot, prompt, outputs in step.new_penalty_states:
            self.penalties[slot] = PenaltyState.create(prompt, outputs, self.vocab_size, dev)
        prompt = self._prompt_logprobs(hidden, step) if step.prompt_spans else None
        if step.num_samples == 0:
            return None, prompt, None, None
        hidden = hidden[step.logits_rows.to(dev, non_blocking=True)]
        sb = step.sampling.to(dev) if step.sampling is not None else None
        # greedy rows and nothing that writes the logits: no fp32 copy of them is needed
        logits = self.model.compute_logits(hidden, upcast=not _plain_greedy(step, sb, vr))
        wants_logprobs = (sb is not None and sb.max_logprobs is not None) or (
            vr is not None and vr.sampling.max_logprobs is not None
        )
        raw = logits.clone() if wants_logprobs else logits
        if step.penalty_rows:
            states = [self.penalties[s] for s in step.penalty_slots]
            apply_penalties(logits, step.penalty_rows, states, step.penalty_params)
        if vr is not None and vr.penalized:
            self._draft_penalties(logits, vr)
        if step.logit_bias is not None:
            apply_logit_bias(logits, *(t.to(dev, non_blocking=True) for t in step.logit_bias))
        if step.bitmask is not None:
            apply_bitmask(logits, step.bitmask.to(dev, non_blocking=True), step.bitmask_rows)
        result = self._sample(logits, raw, sb, step) if sb is not None else None
        verified = self._verify(logits, raw, vr, snapshots) if vr is not None else None
        drafted = (
            self._draft(step.drafting, verified, hidden) if step.drafting is not None else None
        )
        return result, prompt, verified, drafted

    def _draft(self, rows: DraftRows, verified: Verified | None, hidden: torch.Tensor) -> Drafted:
        """The marked sequences' drafts after the tokens this step sampled (`hidden`: the
        target's rows of the step's logits)."""
        assert self.drafting is not None
        accepted = [len(t) - 1 for t in verified.tokens] if verified is not None else []
        # a grammar's matcher sees the step's tokens only after the passes: what they follow
        taken = [
            verified.tokens[v][:-1] if v is not None and verified is not None else []
            for v in rows.verify
        ]
        return draft_passes(
            self.drafting,
            rows,
            self.last_tokens,
            accepted,
            hidden,
            self.generator,
            self.vocab_size,
            taken,
        )

    def _draft_penalties(self, logits: torch.Tensor, vr: VerifyRows) -> None:
        """Penalties on the verify rows: row j of a sequence counts its outputs and the drafts
        before it (drafts[:j]), as if they had been sampled."""
        rows, slots = vr.rows.tolist(), vr.slots.tolist()
        starts = [0, *accumulate(len(d) + 1 for d in vr.drafts)]
        for v in vr.penalized:
            state, draft, params = self.penalties[slots[v]], vr.drafts[v], vr.sampling.params[v]
            states, counts = [], state.output_counts
            for token in draft:
                states.append(PenaltyState(state.prompt_mask, counts))
                counts = counts.clone()
                counts[token] += 1
            states.append(PenaltyState(state.prompt_mask, counts))
            at = rows[starts[v] : starts[v + 1]]
            apply_penalties(logits, at, states, [params] * len(at))

    def _sample(
        self, logits: torch.Tensor, raw: torch.Tensor, sb: SamplingBatch, step: PreparedStep
    ) -> SampleResult:
        """The sequences without drafts: one token each, from their one row."""
        if step.sample_rows is not None:
            rows = step.sample_rows.to(self.device, non_blocking=True)
            # raw is logits itself where no logprobs are wanted: one copy of the rows, not two
            # (a step's whole vocabulary a row: ~0.7 ms for 32 rows of SmolLM2 on 2 cores)
            selected = logits.index_select(0, rows)
            logits, raw = selected, selected if raw is logits else raw.index_select(0, rows)
        penalty_rows = step.penalty_rows
        if step.sample_rows is not None and penalty_rows:
            at = {row: i for i, row in enumerate(step.sample_rows.tolist())}
            penalty_rows = [at[row] for row in penalty_rows]
        result = sample(logits, sb, self.generator)
        slots = step.sample_slots.to(self.device, non_blocking=True)
        self.last_tokens[slots] = result.tokens
        for row, slot in zip(penalty_rows, step.penalty_slots):
            self.penalties[slot].output_counts[result.tokens[row]] += 1
        if sb.max_logprobs is not None:
            result = add_logprobs(result, raw, sb.max_logprobs)
        return result

    def _verify(
        self,
        logits: torch.Tensor,
        raw: torch.Tensor,
        vr: VerifyRows,
        snapshots: list[RequestState],
    ) -> Verified:
        """The sequences with drafts: what the target takes of each, its state rolled back
        where it rejected a draft, and the logprobs of every token taken (from raw rows)."""
        dev = self.device
        sb = vr.sampling.to(dev)
        if vr.run_start is not None:
            mine = logits.narrow(0, vr.run_start, vr.rows.numel())
        else:
            mine = logits.index_select(0, vr.rows.to(dev, non_blocking=True))
        out = verify(mine, vr.drafts, vr.draft_probs, sb, self.generator)
        last = torch.tensor([t[-1] for t in out.tokens], dtype=torch.long)
        self.last_tokens[vr.slots.to(dev, non_blocking=True)] = last.to(dev, non_blocking=True)
        slots = vr.slots.tolist()
        for v in vr.penalized:  # what it took, as if sampled one by one
            taken = torch.tensor(out.tokens[v], dtype=torch.long, device=dev)
            counts = self.penalties[slots[v]].output_counts
            counts.index_add_(0, taken, torch.ones_like(taken, dtype=torch.int32))
        rolled_back: list[int | None] = []
        for snap, (tables, _), n, draft in zip(snapshots, vr.states, out.num_accepted, vr.drafts):
            if n < len(draft) and snap.tensors:
                self.cache.restore_state(snap, tables)
                rolled_back.append(snap.position)
            else:
                rolled_back.append(None)
        logprobs = None
        if sb.max_logprobs is not None:
            flat = torch.tensor([t for ts in out.tokens for t in ts], dtype=torch.long, device=dev)
            taken = [r for seq_rows in out.rows for r in seq_rows]  # of the verify rows
            at = vr.rows.to(dev)[torch.tensor(taken, dtype=torch.long, device=dev)]
            logprobs = add_logprobs(SampleResult(flat, None, None, None), raw[at], sb.max_logprobs)
        return Verified(out.tokens, rolled_back, logprobs)

    def _prompt_logprobs(self, hidden: torch.Tensor, step: PreparedStep) -> TargetLogprobs:
        """Each prompt row's logprob of the next prompt token: full-vocabulary logits for these
        rows only, a bounded number of rows at a time."""
        assert step.prompt_rows is not None and step.prompt_targets is not None
        rows = step.prompt_rows.to(self.device, non_blocking=True)
        targets = step.prompt_targets.to(self.device, non_blocking=True)
        top_n = max(span.top_n for span in step.prompt_spans)
        parts = []
        for i in range(0, rows.numel(), PROMPT_LOGITS_ROWS):
            chunk = slice(i, i + PROMPT_LOGITS_ROWS)
            logits = self.model.compute_logits(hidden[rows[chunk]])
            parts.append(target_logprobs(logits, targets[chunk], top_n))
        return TargetLogprobs.cat(parts)

    def _to_host(
        self,
        result: SampleResult | None,
        prompt: TargetLogprobs | None,
        verified: Verified | None,
        step: PreparedStep,
        drafted: Drafted | None = None,
    ) -> StepResult:
        out = StepResult([], []) if result is None else self._sampled(result, step.sampling)
        if verified is not None:
            out = _merge(out, verified, step.verify)
            for p, tokens in zip(step.verify.sampling.params, verified.tokens):
                if p.constraint is not None:  # held back by the scheduler until now, as above
                    for token in tokens:
                        p.constraint.accept(token)
        if drafted is not None:
            out.drafts = [None] * step.num_samples
            for i, early in zip(drafted.rows.samples, drafted.host()):
                out.drafts[i] = early
        if prompt is not None:
            out.prompt_logprobs = _prompt_entries(prompt, step)
        return out

    @staticmethod
    def _sampled(result: SampleResult, sb: SamplingBatch) -> StepResult:
        tokens = result.tokens.tolist()
        for p, token in zip(sb.params, tokens):
            if p.constraint is not None:  # the scheduler holds the request back until now
                p.constraint.accept(token)
        if result.logprob is None:
            return StepResult(tokens, [None] * len(tokens))
        return StepResult(tokens, _token_logprobs(result, sb.params, [1] * len(tokens)))


def _token_logprobs(
    result: SampleResult, params: list[SamplingParams], counts: list[int]
) -> list[TokenLogprob | None]:
    """Entries of `result`'s tokens, `counts[i]` of them for the i-th sequence (None for
    those of a sequence that asked for no logprobs)."""
    tokens = result.tokens.tolist()
    chosen = result.logprob.tolist()
    top_ids = result.top_ids.tolist() if result.top_ids is not None else None
    top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else None
    out: list[TokenLogprob | None] = []
    rows = (p for p, count in zip(params, counts) for _ in range(count))
    for k, p in enumerate(rows):
        if p.logprobs is None:
            out.append(None)
            continue
        top = list(zip(top_ids[k][: p.logprobs], top_lps[k][: p.logprobs])) if top_ids else []
        out.append(TokenLogprob(tokens[k], chosen[k], top))
    return out


def _merge(plain: StepResult, verified: Verified, vr: VerifyRows) -> StepResult:
    """The step's results in sampling-sequence order: those without drafts from `plain`."""
    counts = [len(t) for t in verified.tokens]
    entries: list[TokenLogprob | None] = (
        _token_logprobs(verified.logprobs, vr.sampling.params, counts)
        if verified.logprobs is not None
        else [None] * sum(counts)
    )
    by_seq = dict(zip(vr.seqs, range(len(vr.seqs))))
    starts = [sum(counts[:i]) for i in range(len(counts))]
    out = StepResult([], [])
    p = 0
    for i in range(len(plain.tokens) + len(vr.seqs)):
        v = by_seq.get(i)
        if v is None:
            out.tokens.append(plain.tokens[p])
            out.logprobs.append(plain.logprobs[p])
            out.accepted.append([])
            out.accepted_logprobs.append([])
            out.rolled_back.append(None)
            p += 1
            continue
        tokens = verified.tokens[v]
        lps = entries[starts[v] : starts[v] + len(tokens)]
        out.tokens.append(tokens[-1])
        out.logprobs.append(lps[-1])
        out.accepted.append(tokens[:-1])
        out.accepted_logprobs.append([lp for lp in lps[:-1] if lp is not None])
        out.rolled_back.append(verified.rolled_back[v])
    return out


def _to_cpu(result: Any) -> Any:
    """A result dataclass of device tensors, copied to the host asynchronously."""
    if result is None:
        return None
    values = vars(result).values()
    return type(result)(*(None if t is None else t.to("cpu", non_blocking=True) for t in values))


def _prompt_entries(
    prompt: TargetLogprobs, step: PreparedStep
) -> list[tuple[int, int, list[TokenLogprob]]]:
    assert step.prompt_targets is not None
    chosen, ranks = prompt.logprob.tolist(), prompt.rank.tolist()
    targets = step.prompt_targets.tolist()
    top_ids = prompt.top_ids.tolist() if prompt.top_ids is not None else None
    top_lps = prompt.top_logprobs.tolist() if prompt.top_logprobs is not None else None
    out, row = [], 0
    for span in step.prompt_spans:
        entries = []
        for k in range(row, row + span.count):
            top = list(zip(top_ids[k][: span.top_n], top_lps[k][: span.top_n])) if top_ids else []
            entries.append(TokenLogprob(targets[k], chosen[k], top, ranks[k]))
        out.append((span.seq_index, span.first, entries))
        row += span.count
    return out


def _plain_greedy(step: PreparedStep, sb: SamplingBatch | None, vr: VerifyRows | None) -> bool:
    """Whether every row of the step takes its argmax and nothing else reads or writes the
    logits: greedy verifies (their drafts accepted while the argmax agrees) but no draft
    passes, no penalties, bias, grammar or logprobs."""
    batches = [b for b in (sb, vr.sampling if vr is not None else None) if b is not None]
    return (
        bool(batches)
        and all(b.all_greedy and b.max_logprobs is None for b in batches)
        and (vr is None or not vr.penalized)
        and step.drafting is None
        and not step.penalty_rows
        and step.logit_bias is None
        and step.bitmask is None
    )

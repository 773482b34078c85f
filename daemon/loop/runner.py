"""Model runner: turns a scheduled step into device tensors (host side) and runs
forward + sampling (device side, off the event loop).

Tokens sampled in step N are written to `last_tokens[slot]` on the device; a
decode in step N+1 whose input the host has not seen yet carries -1 and reads
it from there, so step N+1 never waits for step N's output on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from daemon.kv.block_copy import BlockCopier
from daemon.kv.manager import KVManager
from daemon.kv.spec import KVGroup
from daemon.loop.constraint import GrammarConstraint, allocate_bitmask, apply_bitmask
from daemon.loop.cuda_graphs import DecodeGraphs, V4DecodeGraphs
from daemon.loop.prefix import CacheOps, RestoreOp
from daemon.loop.request import SamplingParams, TokenLogprob
from daemon.loop.sampler import (
    PenaltyState,
    SampleResult,
    SamplingBatch,
    add_logprobs,
    apply_penalties,
    sample,
)
from daemon.loop.scheduler import SchedulerStep
from daemon.models.attention import PagedKVCache, SeqSlice
from daemon.models.deepseek_v4.cache import V4Cache


@dataclass
class PreparedStep:
    input_ids: torch.Tensor  # [T], -1 where the token is on the device only
    placeholder_rows: torch.Tensor  # rows of input_ids to fill from last_tokens
    placeholder_slots: torch.Tensor  # slots they read
    positions: torch.Tensor  # [T]
    attention: Any  # the model's own per-step attention metadata (has .to(device))
    logits_rows: torch.Tensor  # [S] last token of each sampling sequence
    sample_slots: torch.Tensor  # [S]
    sampling: SamplingBatch | None
    new_penalty_states: list[tuple[int, list[int], list[int]]]  # (slot, prompt, outputs)
    penalty_rows: list[int]
    penalty_slots: list[int]
    bitmask: torch.Tensor | None  # [S, ceil(V/32)] int32 grammar masks (constrained rows only)
    bitmask_rows: list[int]
    cache_ops: CacheOps  # tier moves and sliding-window saves, before anything reuses a block
    restores: list[tuple[RestoreOp, list[list[int]]]]  # with the request's block tables


@dataclass
class StepResult:
    tokens: list[int]  # one per sampling sequence, in step order
    logprobs: list[TokenLogprob | None]


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_groups: list[KVGroup],
        num_blocks: list[int],
        device: torch.device,
        max_num_seqs: int,
        seed: int = 0,
        cpu_threads: int = 0,
        cuda_graphs: bool = False,
    ) -> None:
        self.model = model
        self.device = device
        self.cache = model.allocate_cache(kv_groups, num_blocks, device)
        paged = [i for i, g in enumerate(kv_groups) if not g.spec.per_request]
        self.copier = BlockCopier([self.cache.block_views(i) for i in paged]) if paged else None
        self.vocab_size = model.vocab_size
        self.last_tokens = torch.zeros(max_num_seqs, dtype=torch.long, device=device)
        self.penalties: dict[int, PenaltyState] = {}
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
        self.after_forward: Callable[[], None] | None = None  # e.g. MoE load statistics
        # decode steps by graph replay, on CUDA
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs and device.type == "cuda":
            if isinstance(self.cache, PagedKVCache):
                self.graphs = DecodeGraphs(model, self.cache, device, max_num_seqs)
            elif isinstance(self.cache, V4Cache):
                self.graphs = V4DecodeGraphs(model, self.cache, device, max_num_seqs)

    # ---- host side (event loop thread) ---------------------------------------------------

    def prepare(self, step: SchedulerStep, kv: KVManager, cache_ops: CacheOps) -> PreparedStep:
        input_ids: list[int] = []
        positions: list[int] = []
        placeholder_rows: list[int] = []
        placeholder_slots: list[int] = []
        slices: list[SeqSlice] = []
        logits_rows: list[int] = []
        sample_slots: list[int] = []
        sample_params: list[SamplingParams] = []
        sample_indices: list[int] = []
        new_penalty_states = []
        penalty_rows: list[int] = []
        penalty_slots: list[int] = []
        restores: list[tuple[RestoreOp, list[list[int]]]] = []
        constrained: list[tuple[int, GrammarConstraint]] = []

        for seq in step.seqs:
            req = seq.request
            start, n = seq.start, seq.num_tokens
            end = start + n
            q_start = len(input_ids)
            known = min(end, req.num_known_tokens)
            if start < known:
                input_ids.extend(
                    req.prompt_ids[start:known]
                    if known <= req.num_prompt_tokens
                    else [req.token_at(p) for p in range(start, known)]
                )
            for _ in range(max(known, start), end):
                placeholder_rows.append(len(input_ids))
                placeholder_slots.append(req.slot)
                input_ids.append(-1)
            positions.extend(range(start, end))
            tables = kv.block_tables(req.request_id)
            floor = req.replay_from if seq.replay else 0
            slices.append(SeqSlice(q_start, start, n, tables, seq.is_decode, seq.replay, floor))
            if seq.restore is not None:
                restores.append((seq.restore, [list(t) for t in tables]))
            if seq.first and req.params.has_penalties:
                new_penalty_states.append((req.slot, list(req.prompt_ids), list(req.output_ids)))
            if seq.samples:
                if req.params.has_penalties:
                    penalty_rows.append(len(logits_rows))
                    penalty_slots.append(req.slot)
                if req.params.constraint is not None:
                    constrained.append((len(logits_rows), req.params.constraint))
                logits_rows.append(len(input_ids) - 1)
                sample_slots.append(req.slot)
                sample_params.append(req.params)
                sample_indices.append(seq.sample_index)

        bitmask, bitmask_rows = None, []
        if constrained:
            bitmask = allocate_bitmask(len(logits_rows), self.vocab_size)
            bitmask_rows = [row for row, c in constrained if c.fill(bitmask, row)]
            bitmask = bitmask if bitmask_rows else None
        return PreparedStep(
            input_ids=torch.tensor(input_ids, dtype=torch.long),
            placeholder_rows=torch.tensor(placeholder_rows, dtype=torch.long),
            placeholder_slots=torch.tensor(placeholder_slots, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            attention=self.cache.build_attention(slices),
            logits_rows=torch.tensor(logits_rows, dtype=torch.long),
            sample_slots=torch.tensor(sample_slots, dtype=torch.long),
            sampling=SamplingBatch.build(sample_params, sample_indices, self.vocab_size)
            if sample_params
            else None,
            new_penalty_states=new_penalty_states,
            penalty_rows=penalty_rows,
            penalty_slots=penalty_slots,
            bitmask=bitmask,
            bitmask_rows=bitmask_rows,
            cache_ops=cache_ops,
            restores=restores,
        )

    # ---- device side (worker thread) -------------------------------------------------------

    def execute_cache_ops(self, ops: CacheOps) -> None:
        """Cache ops with no step to ride on (the engine is idle)."""
        if self.stream is None:
            self.run_cache_ops(ops)
            return
        with self.device_module.stream(self.stream):
            self.run_cache_ops(ops)

    @torch.inference_mode()
    def run_cache_ops(self, ops: CacheOps) -> None:
        """Block saves first (a block saved may be the target of a load), then loads, then
        sliding-window snapshots."""
        if ops.block_saves:
            payloads = self.copier.gather([s.blocks for s in ops.block_saves])
            for save, payload in zip(ops.block_saves, payloads):
                save.entry.payload = payload
        if ops.block_loads:
            self.copier.scatter(
                [load.blocks for load in ops.block_loads],
                [load.entry.payload for load in ops.block_loads],
            )
        for save in ops.swa_saves:
            save.snapshot.tensor = self.cache.save_swa(save.swa_block, save.position)

    @torch.inference_mode()
    def execute(self, step: PreparedStep, launched: Callable[[], None] | None = None) -> StepResult:
        """Run one step; `launched` is called once all of its work is queued on the device,
        before this thread blocks on it (on a CPU: once it is done)."""
        if self.stream is None:
            result = self._execute(step)
            if launched is not None:
                launched()
            return StepResult([], []) if result is None else self._to_host(result, step.sampling)
        # Accelerators: launch on our stream, copy the few result values to the
        # host asynchronously and block this worker thread (not the event loop) on an event.
        with self.device_module.stream(self.stream):
            result = self._execute(step)
            if result is not None:
                result = SampleResult(
                    *(
                        None if t is None else t.to("cpu", non_blocking=True)
                        for t in vars(result).values()
                    )
                )
                done = self.device_module.Event()
                done.record(self.stream)
        if launched is not None:
            launched()
        if result is None:
            return StepResult([], [])
        done.synchronize()
        return self._to_host(result, step.sampling)

    def _execute(self, step: PreparedStep) -> SampleResult | None:
        dev = self.device
        if self.cpu_threads and torch.get_num_threads() != self.cpu_threads:
            torch.set_num_threads(self.cpu_threads)
        self.run_cache_ops(step.cache_ops)
        for restore, tables in step.restores:
            self.cache.restore(restore, tables)
        input_ids = step.input_ids.to(dev, non_blocking=True)
        if step.placeholder_rows.numel():
            rows = step.placeholder_rows.to(dev, non_blocking=True)
            input_ids[rows] = self.last_tokens[step.placeholder_slots.to(dev, non_blocking=True)]
        positions, attention = step.positions.to(dev, non_blocking=True), step.attention.to(dev)
        hidden = self.graphs.run(input_ids, positions, attention) if self.graphs else None
        if hidden is None:
            hidden = self.model(input_ids, positions, attention, self.cache)
        if self.after_forward is not None:
            self.after_forward()
        for slot, prompt, outputs in step.new_penalty_states:
            self.penalties[slot] = PenaltyState.create(prompt, outputs, self.vocab_size, dev)
        if step.sampling is None:
            return None
        logits = self.model.compute_logits(hidden[step.logits_rows.to(dev, non_blocking=True)])
        sb = step.sampling.to(dev)
        raw = logits.clone() if sb.max_logprobs is not None else logits
        if step.penalty_rows:
            states = [self.penalties[s] for s in step.penalty_slots]
            params = [sb.params[r] for r in step.penalty_rows]
            apply_penalties(logits, step.penalty_rows, states, params)
        if step.bitmask is not None:
            apply_bitmask(logits, step.bitmask.to(dev, non_blocking=True), step.bitmask_rows)
        result = sample(logits, sb, self.generator)
        slots = step.sample_slots.to(dev, non_blocking=True)
        self.last_tokens[slots] = result.tokens
        for row, slot in zip(step.penalty_rows, step.penalty_slots):
            self.penalties[slot].output_counts[result.tokens[row]] += 1
        if sb.max_logprobs is not None:
            result = add_logprobs(result, raw, sb.max_logprobs)
        return result

    @staticmethod
    def _to_host(result: SampleResult, sb: SamplingBatch) -> StepResult:
        tokens = result.tokens.tolist()
        for p, token in zip(sb.params, tokens):
            if p.constraint is not None:  # the scheduler holds the request back until now
                p.constraint.accept(token)
        if result.logprob is None:
            return StepResult(tokens, [None] * len(tokens))
        chosen = result.logprob.tolist()
        top_ids = result.top_ids.tolist() if result.top_ids is not None else None
        top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        logprobs: list[TokenLogprob | None] = []
        for i, p in enumerate(sb.params):
            if p.logprobs is None:
                logprobs.append(None)
                continue
            top = list(zip(top_ids[i][: p.logprobs], top_lps[i][: p.logprobs])) if top_ids else []
            logprobs.append(TokenLogprob(tokens[i], chosen[i], top))
        return StepResult(tokens, logprobs)

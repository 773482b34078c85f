"""Speculative decoding on a simulated node: the real Speculator and verify-length policy
(loop/spec/policy.py) inside the node's Scheduler, a drafter whose drafts each request accepts
at its own rate (seeded draws), and the policy's step cost read from the simulator's table."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from daemon.loop.request import Request
from daemon.loop.scheduler import ScheduledSeq, Scheduler
from daemon.loop.spec.base import Draft
from daemon.loop.spec.policy import build_policy
from daemon.loop.spec.speculator import Speculator
from daemon.sim.spec_config import SpecConfig
from daemon.sim.table import CostTable

DRAFT_TOKEN = -2  # a draft's tokens: never a prompt's (trace.block_tokens) nor an output's


class RateDrafter:
    """Proposes k drafts for any request, each with its request's acceptance rate as the
    confidence (the policy's calibrator learns how far to trust it)."""

    name = "sim"

    def __init__(self, cfg: SpecConfig, node: int) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng([cfg.seed, 2, node])
        self.rates: dict[str, float] = {}

    def rate(self, req: Request) -> float:
        got = self.rates.get(req.request_id)
        if got is None:
            c = self.cfg
            got = float(np.clip(c.acceptance + c.spread * (2 * self.rng.random() - 1), 0, 1))
            self.rates[req.request_id] = got
        return got

    def propose(self, req: Request, k: int) -> Draft:
        return Draft([DRAFT_TOKEN] * k, [self.rate(req)] * k)

    def observe(self, req: Request, draft: Draft, accepted: int) -> None:
        """The rate is fixed: nothing to learn."""

    def finished(self, req: Request) -> None:
        self.rates.pop(req.request_id, None)

    def accepted(self, req: Request, verified: int) -> int:
        """How many of `verified` drafts the request accepts: those before the first miss."""
        misses = np.flatnonzero(self.rng.random(verified) >= self.rate(req))
        return int(misses[0]) if len(misses) else verified


class TableSpecCost:
    """The policy's StepCost (loop/spec/base.py) from the simulator's table, as StepCost in
    sim/cost.py prices a step: decode and draft rows as decodes at the node's mean context
    now, the tokens beyond them as one prefill chunk."""

    def __init__(self, table: CostTable, context: Callable[[], float]) -> None:
        self.table, self.context = table, context

    def seconds(
        self, num_tokens: int, num_seqs: int, num_drafts: int = 0, context: float | None = None
    ) -> float:
        rows = num_seqs + num_drafts
        seconds = self.table.decode.at(rows, self.context() if context is None else context)
        extra = num_tokens - rows
        return seconds + (self.table.prefill.at(extra, 0) if extra > 0 else 0.0)


class SimSpeculation:
    """A node's Speculator (given to its Scheduler) and the outcome of each verify."""

    def __init__(
        self, cfg: SpecConfig, table: CostTable, node: int, context: Callable[[], float]
    ) -> None:
        """`context`: the node's running requests' mean context now (the step cost's)."""
        self.drafter = RateDrafter(cfg, node)
        # as `serve --spec-policy` builds it (the nodes schedule without the overlap's hold)
        policy = build_policy(
            cfg.policy, cfg.k, TableSpecCost(table, context), min_gain=cfg.min_gain
        )
        self.speculator = Speculator(self.drafter, policy, cfg.k)

    def verified(self, seq: ScheduledSeq, scheduler: Scheduler) -> int:
        """A verify step is done (as Engine._verified): its accepted drafts, drawn."""
        req = seq.request
        accepted = self.drafter.accepted(req, len(seq.draft))
        scheduler.verified(seq, accepted, None)
        if seq.proposal is not None and not req.finished:
            self.speculator.observe(req, seq.proposal, len(seq.draft), accepted)
        return accepted

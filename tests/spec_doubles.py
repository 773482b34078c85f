"""Test doubles for speculative decoding: a drafter that proposes a reference run's
continuation with wrong tokens put in, a policy that verifies every draft in full, and the
engine helpers the speculative tests share (start one, run requests, their tokens)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from daemon.build.config import EngineConfig
from daemon.build.engine import build_engine
from daemon.loop.engine import Engine
from daemon.loop.request import Request, RequestOutput, SamplingParams
from daemon.loop.spec.base import Candidate, Draft
from daemon.loop.spec.speculator import Speculator


@dataclass
class OracleDrafter:
    """Proposes what the reference produced after the request's known tokens (found by its
    prompt), with the draft token at output index i wrong wherever `wrong(i)`; nothing for
    a prompt it does not know. Counts what it was told."""

    reference: dict[tuple[int, ...], list[int]]
    vocab: int
    every: int = 3  # output indices i with i % every == every - 1 are drafted wrong (0: none)
    name: str = "oracle"
    observed: list[tuple[int, int]] = field(default_factory=list)  # (verified, accepted)
    asked: set[tuple[int, ...]] = field(default_factory=set)  # prompts it proposed for
    ended: int = 0

    def wrong(self, i: int) -> bool:
        return self.every > 0 and i % self.every == self.every - 1

    def propose(self, req: Request, k: int) -> Draft:
        self.asked.add(tuple(req.prompt_ids))
        ref = self.reference.get(tuple(req.prompt_ids))
        if ref is None:
            return Draft([], [])
        done = len(req.output_ids)
        tokens = [
            (t + 1) % self.vocab if self.wrong(i) else t
            for i, t in enumerate(ref[done : done + k], start=done)
        ]
        return Draft(tokens, [0.5] * len(tokens))

    def observe(self, req: Request, draft: Draft, accepted: int) -> None:
        self.observed.append((len(draft.tokens), accepted))

    def finished(self, req: Request) -> None:
        self.ended += 1


@dataclass
class VerifyAll:
    """Every candidate verifies all its drafts."""

    outcomes: list[tuple[int, int]] = field(default_factory=list)
    steps: list[tuple[int, int, int, float]] = field(default_factory=list)

    def choose(
        self,
        candidates: list[Candidate],
        num_seqs: int,
        num_tokens: int,
        context: float | None = None,
    ) -> list[int]:
        return [c.max_len for c in candidates]

    def observe(self, confidence: list[float], verified: int, accepted: int) -> None:
        self.outcomes.append((verified, accepted))

    def observe_step(
        self,
        num_tokens: int,
        num_seqs: int,
        num_drafts: int,
        seconds: float,
        context: float | None = None,
    ) -> None:
        self.steps.append((num_tokens, num_seqs, num_drafts, seconds))

    def calibration(self) -> list[dict[str, float | int | None]]:
        return []  # it keeps outcomes, not a calibrated map


def speculate(engine: Engine, drafter: OracleDrafter, k: int = 5) -> Speculator:
    """Turn speculation on in a built engine, with `drafter` and VerifyAll."""
    spec = Speculator(drafter, VerifyAll(), k)
    engine.scheduler.speculator = spec
    return spec


async def start_engine(**settings) -> Engine:
    """An engine built from `settings` (EngineConfig fields), started."""
    engine, _ = build_engine(EngineConfig(**settings))
    await engine.start()
    return engine


async def collect(engine: Engine, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params)]


async def run_all(
    engine: Engine, prompts: list[list[int]], params: list[SamplingParams]
) -> list[list[RequestOutput]]:
    """The requests at once (batched as the scheduler admits them)."""
    return await asyncio.gather(*(collect(engine, p, sp) for p, sp in zip(prompts, params)))


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def first_pair_counts(outputs: list[list[RequestOutput]], vocab: int) -> torch.Tensor:
    """How often each (first, second) output token pair came, flattened [vocab * vocab]: for a
    chi-square against p(t1) p(t2 | t1)."""
    pairs = torch.tensor([t[0] * vocab + t[1] for t in map(tokens, outputs)])
    return torch.bincount(pairs, minlength=vocab * vocab)

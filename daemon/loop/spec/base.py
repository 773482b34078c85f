"""The seams of speculative decoding: what a drafter proposes, what the verify-length policy
decides from it, and the step-cost model that policy weighs against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from daemon.loop.request import Request


# with overlap, a step runs beside one in flight only where at least this share of the
# running requests can join it (neither verifying nor held to be drafted) or a request waits
# to be admitted: a decode step of a few sequences costs nearly a full one (every weight read
# for a few tokens), while waiting for the step in flight costs only the loop's turn. The
# scheduler applies it; the adaptive policy prices a verify plan by it.
OVERLAP_MIN_SHARE = 0.5


@dataclass
class Draft:
    """A drafter's proposal for the tokens after a request's known ones."""

    tokens: list[int]
    # per position j: the drafter's raw estimate that tokens[j] is accepted given that
    # tokens[:j] are (in [0, 1]; the policy calibrates it against observed acceptance)
    confidence: list[float]
    # [len(tokens), V] the draft distribution each token was drawn from, where the drafter has
    # one (model drafters); None: a point mass on each token (n-gram lookups)
    probs: torch.Tensor | None = None


class Drafter(Protocol):
    """Proposes continuations from a request's known tokens, on the loop thread."""

    name: str

    def propose(self, req: Request, k: int) -> Draft:
        """At most `k` tokens to follow `req.prompt_ids + req.output_ids` (possibly none)."""
        ...

    def observe(self, req: Request, draft: Draft, accepted: int) -> None:
        """The outcome of a verified draft: its first `accepted` tokens were accepted (of those
        verified, which may be fewer than proposed)."""
        ...

    def finished(self, req: Request) -> None:
        """The request ended: what it produced may serve later requests."""
        ...


class StepCost(Protocol):
    """The device's step time, profiled at engine start."""

    def seconds(
        self, num_tokens: int, num_seqs: int, num_drafts: int = 0, context: float | None = None
    ) -> float:
        """A forward + sampling step of `num_tokens` tokens over `num_seqs` sequences, with the
        rollback of rejected drafts; `num_drafts` of the tokens are draft (verify) rows, the
        rest beyond one per sequence prefill chunks' tokens; the decode and draft rows attend
        `context` positions on average (None: unknown)."""
        ...


@dataclass
class Candidate:
    """A request that may verify drafts this step."""

    request_id: str
    confidence: list[float]  # its draft's raw per-position confidences
    max_len: int  # the most drafts it may verify (tokens left, draft length)


class SpecPolicy(Protocol):
    """How many drafts each candidate verifies in a step."""

    def choose(
        self,
        candidates: list[Candidate],
        num_seqs: int,
        num_tokens: int,
        context: float | None = None,
    ) -> list[int]:
        """Drafts to verify per candidate (each in 0..max_len; 0: a plain decode), for a step
        that without drafts computes `num_tokens` tokens over `num_seqs` sequences (the
        candidates' own decode rows included), whose decodes attend `context` positions on
        average (None: unknown)."""
        ...

    def observe(self, confidence: list[float], verified: int, accepted: int) -> None:
        """A verified draft's outcome (`confidence` as proposed): calibration data."""
        ...

    def observe_step(
        self,
        num_tokens: int,
        num_seqs: int,
        num_drafts: int,
        seconds: float,
        context: float | None = None,
    ) -> None:
        """A step ran `num_tokens` rows over `num_seqs` sequences, `num_drafts` of them draft
        rows (the rest decodes and prefill chunks), in `seconds` (host preparation and
        device), its decode and draft rows attending `context` positions on average: cost
        data."""
        ...

    def calibration(self) -> list[dict[str, float | int | None]]:
        """Its calibration so far, bin by bin: the raw confidences' range (lo, hi), positions
        tested (trials), accepted, their confidence_sum, expected and observed acceptance."""
        ...

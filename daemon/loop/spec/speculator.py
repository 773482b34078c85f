"""The Speculator: a drafter and a verify-length policy composed for the scheduler (drafts for a
step's decodes, cut to the lengths the policy chooses) and fed back each verified outcome."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from daemon.loop.spec.base import Candidate, Draft, Drafter, SpecPolicy
from daemon.loop.spec.stats import SpecStats

if TYPE_CHECKING:
    from daemon.loop.request import Request


@dataclass
class Planned:
    """A request's draft as proposed and how many of its tokens the step verifies (0: none)."""

    proposal: Draft
    length: int

    @property
    def tokens(self) -> list[int]:
        return self.proposal.tokens[: self.length]


@dataclass
class Speculator:
    drafter: Drafter
    policy: SpecPolicy
    k: int  # the most drafts a request verifies in a step
    stats: SpecStats = field(default_factory=SpecStats)

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError("speculation needs at least one draft token per step")
        self.stats.drafter = self.stats.drafter or self.drafter.name
        self.stats.policy = self.stats.policy or type(self.policy).__name__

    def plan(
        self,
        requests: list[tuple[Request, int]],
        num_seqs: int,
        num_tokens: int,
        context: float | None = None,
    ) -> list[Planned]:
        """Drafts for `requests` (each with the most drafts it may verify), proposed on the
        loop thread; the policy chooses each one's length for a step of `num_tokens` tokens
        over `num_seqs` sequences without drafts, whose decodes attend `context` positions on
        average. Aligned with `requests`."""
        planned: list[Planned] = []
        candidates: list[Candidate] = []
        chosen: list[int] = []  # indices into `planned` of the candidates
        for req, limit in requests:
            limit = min(limit, self.k)
            draft = self.drafter.propose(req, limit) if limit > 0 else Draft([], [])
            draft = _cut(draft, limit)
            planned.append(Planned(draft, 0))
            if draft.tokens:
                chosen.append(len(planned) - 1)
                candidates.append(
                    Candidate(req.request_id, list(draft.confidence), len(draft.tokens))
                )
        if candidates:
            lengths = self.policy.choose(candidates, num_seqs, num_tokens, context)
            for i, c, n in zip(chosen, candidates, lengths, strict=True):
                planned[i].length = max(0, min(int(n), c.max_len))
        return planned

    def worth_holding(self, req: Request, limit: int, num_seqs: int) -> bool:
        """Whether a decode whose last token is still in flight is worth holding back a step
        for drafts: the policy would verify some of a draft made from its known tokens, one
        position early (its first token guesses the one in flight, the rest follow it), in a
        decode step of `num_seqs` sequences. `limit`: the most drafts it may verify after its
        next token. Optimistic (as if the guess were right), so it declines only holds that
        would verify nothing even then."""
        limit = min(limit, self.k)
        if limit <= 0:
            return False
        confidence = list(self.drafter.propose(req, limit + 1).confidence[1:])
        if not confidence:
            return False
        candidate = Candidate(req.request_id, confidence, len(confidence))
        return any(self.policy.choose([candidate], num_seqs, num_seqs, req.num_computed))

    def observe(self, req: Request, proposal: Draft, verified: int, accepted: int) -> None:
        """A verified draft's outcome: to the drafter, the policy's calibration and the stats."""
        self.drafter.observe(req, proposal, accepted)
        self.policy.observe(proposal.confidence, verified, accepted)
        self.stats.on_verified(verified, accepted)

    def observe_step(
        self,
        num_tokens: int,
        num_seqs: int,
        num_drafts: int,
        seconds: float,
        context: float | None = None,
    ) -> None:
        """A step's measured time (`num_drafts` of its `num_tokens` are draft rows, which with
        the decodes attend `context` positions on average): to the policy's cost."""
        self.policy.observe_step(num_tokens, num_seqs, num_drafts, seconds, context)

    def price(
        self, num_tokens: int, num_seqs: int, num_drafts: int, context: float | None = None
    ) -> float | None:
        """The seconds the policy's cost expects of such a step (None: its policy has none)."""
        cost = getattr(self.policy, "cost", None)
        return None if cost is None else cost.seconds(num_tokens, num_seqs, num_drafts, context)

    def finished(self, req: Request) -> None:
        self.drafter.finished(req)

    def as_dict(self) -> dict[str, object]:
        """The counters and the policy's calibration (bins a draft position has reached)."""
        bins = [b for b in self.policy.calibration() if b["trials"]]
        out = self.stats.as_dict() | {"spec_calibration": bins}
        corrections = getattr(getattr(self.policy, "cost", None), "corrections", None)
        if corrections is not None:
            out["spec_cost_corrections"] = corrections()
        return out


def _cut(draft: Draft, limit: int) -> Draft:
    if len(draft.tokens) <= limit and len(draft.confidence) == len(draft.tokens):
        return draft
    n = min(limit, len(draft.tokens))
    probs = draft.probs[:n] if draft.probs is not None else None
    return Draft(draft.tokens[:n], draft.confidence[:n], probs)

"""Counters of speculative decoding since start: drafts verified and accepted (by position),
and the verify budget chosen per step, for /metrics and /health."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    drafter: str = ""
    policy: str = ""
    num_drafts: int = 0  # drafts verified (one per speculating request and step)
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0
    # per draft position j: drafts verified that far, and accepted there
    verified_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    num_steps: int = 0  # steps in which some request verified drafts
    budget_tokens: int = 0  # draft tokens chosen over those steps
    last_budget: int = 0  # draft tokens chosen in the last step that scheduled any

    def on_budget(self, tokens: int) -> None:
        """A step was scheduled with `tokens` draft tokens to verify in all."""
        if tokens:
            self.num_steps += 1
            self.budget_tokens += tokens
        self.last_budget = tokens

    def on_verified(self, verified: int, accepted: int) -> None:
        grow = verified - len(self.verified_by_position)
        if grow > 0:
            self.verified_by_position.extend([0] * grow)
            self.accepted_by_position.extend([0] * grow)
        self.num_drafts += 1
        self.num_draft_tokens += verified
        self.num_accepted_tokens += accepted
        for j in range(verified):
            self.verified_by_position[j] += 1
            self.accepted_by_position[j] += j < accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying request gets per step: its accepted drafts and one more."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def acceptance_by_position(self) -> list[float]:
        """Per position j: the fraction of drafts verified that far that were accepted there."""
        return [
            a / v if v else 0.0
            for a, v in zip(self.accepted_by_position, self.verified_by_position)
        ]

    def as_dict(self) -> dict[str, object]:
        return {
            "spec_drafter": self.drafter,
            "spec_policy": self.policy,
            "spec_drafts": self.num_drafts,
            "spec_draft_tokens": self.num_draft_tokens,
            "spec_accepted_tokens": self.num_accepted_tokens,
            "spec_acceptance_rate": round(self.acceptance_rate, 4),
            "spec_mean_accepted_length": round(self.mean_accepted_length, 4),
            "spec_acceptance_by_position": [round(r, 4) for r in self.acceptance_by_position()],
            "spec_verified_by_position": list(self.verified_by_position),
            "spec_accepted_by_position": list(self.accepted_by_position),
            "spec_steps": self.num_steps,
            "spec_budget_tokens": self.budget_tokens,
            "spec_budget_last": self.last_budget,
            "spec_budget_mean": round(self.budget_tokens / self.num_steps, 4)
            if self.num_steps
            else 0.0,
        }

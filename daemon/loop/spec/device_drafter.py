"""Drafts the runner makes on the device at the end of a step (layer skipping, a separate draft
model: loop/early_exit.py), handed to the speculator at the next schedule if they still follow
the request's known tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from daemon.loop.spec.base import Draft

if TYPE_CHECKING:
    from daemon.loop.request import Request


@dataclass
class EarlyDraft:
    """Drafts made on the device after a step: they follow the request's first `follows` tokens,
    the last of which is `last` (the token that step sampled)."""

    follows: int
    last: int
    draft: Draft


@dataclass
class DeviceDrafter:
    """Proposes what the runner drafted after the request's last step (the scheduler marks the
    requests to draft for: those whose next decode will take drafts). `name`: the network that
    drafts (`layer-skip`, `draft-model`), for the stats."""

    name: str
    _drafts: dict[str, EarlyDraft] = field(default_factory=dict)

    def receive(self, req: Request, early: EarlyDraft) -> None:
        """The drafts of the step just processed (replacing any older ones)."""
        self._drafts[req.request_id] = early

    def propose(self, req: Request, k: int) -> Draft:
        early = self._drafts.pop(req.request_id, None)
        n = req.num_known_tokens
        if early is None or early.follows != n or req.token_at(n - 1) != early.last:
            return Draft([], [])
        d = early.draft
        probs = d.probs[:k] if d.probs is not None else None
        return Draft(d.tokens[:k], d.confidence[:k], probs)

    def observe(self, req: Request, draft: Draft, accepted: int) -> None:
        """Nothing to learn: the confidences are the draft network's own probabilities (the
        policy calibrates them)."""

    def finished(self, req: Request) -> None:
        self._drafts.pop(req.request_id, None)

"""Self-drafting by layer skipping: the drafts the runner makes on the device at the end of a step
from the target's first layers (loop/early_exit.py), handed to the speculator at the next
schedule if they still follow the request's known tokens."""

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
class LayerSkipDrafter:
    """Proposes what the runner drafted after the request's last step; the scheduler asks it
    which requests to draft for (`wants`), so that drafts the policy keeps declining stop
    costing passes, probed again every few decodes."""

    name: str = "layer-skip"
    _drafts: dict[str, EarlyDraft] = field(default_factory=dict)
    # per request: decodes since it was last drafted for
    _idle: dict[str, int] = field(default_factory=dict)

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

    def wants(self, req: Request, now: bool, probe_every: int) -> bool:
        """Whether to draft for `req` at the end of the step being scheduled. `now`: its next
        step will take drafts (it verifies some in this one, or the scheduler will hold it
        back for them); else once every `probe_every` decodes since it last took any, to see
        whether the policy wants them again."""
        rid = req.request_id
        if now:
            self._idle[rid] = 0
            return True
        idle = self._idle.get(rid, 0) + 1
        probe = idle >= probe_every
        self._idle[rid] = 0 if probe else idle
        return probe

    def observe(self, req: Request, draft: Draft, accepted: int) -> None:
        """Nothing to learn: the confidences are the draft model's own probabilities (the
        policy calibrates them)."""

    def finished(self, req: Request) -> None:
        self._drafts.pop(req.request_id, None)
        self._idle.pop(req.request_id, None)

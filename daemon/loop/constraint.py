"""Constrained decoding with xgrammar: a per-request grammar matcher that masks the logits of
its row each step (and its verify rows along a draft) and is advanced with each token taken."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    import xgrammar as xgr

# xgrammar is imported where a grammar is used, not with the runner: it imports transformers
# (~1 s of a start), and a daemon serving no constrained request never needs it


class Constraint(Protocol):
    """A request's constrained decoding, stateful: masks its logits row before each sample
    and sees each sampled token (SamplingParams.constraint)."""

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into bitmask[row]; False when unconstrained now."""
        ...

    def fill_draft(
        self, bitmask: torch.Tensor, row: int, draft: list[int]
    ) -> tuple[int, list[int]]:
        """Walk `draft`: into bitmask[row + j] the tokens allowed after draft[:j], for j up to
        the first draft token disallowed (or len(draft)). Returns how many leading drafts are
        allowed and the rows written (those where it constrains); its state is left as it was."""
        ...

    def fill_after(self, bitmask: torch.Tensor, row: int, tokens: list[int]) -> bool:
        """Write into bitmask[row] the tokens allowed after `tokens` (which follow those it has
        seen): a draft pass's mask. False where it does not constrain there, or `tokens` leave
        its language; its state is left as it was."""
        ...

    def accept(self, token: int) -> None: ...


class GrammarConstraint:
    """One request's matcher. With `trigger` set (the end-of-thinking token), output is free
    until that token is sampled; the grammar governs everything after it."""

    def __init__(self, compiled: xgr.CompiledGrammar, trigger: int | None = None) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.trigger = trigger
        self.active = trigger is None

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Writes the allowed next tokens into bitmask[row]; False when unconstrained now."""
        if not self.active or self.matcher.is_terminated():
            return False
        self.matcher.fill_next_token_bitmask(bitmask, row)
        return True

    def fill_draft(
        self, bitmask: torch.Tensor, row: int, draft: list[int]
    ) -> tuple[int, list[int]]:
        """The matcher steps along the draft as `accept` would, then rolls back as many steps."""
        active, steps, rows = self.active, 0, []
        allowed = len(draft)
        try:
            for j in range(len(draft) + 1):
                governs = self.fill(bitmask, row + j)
                if governs:
                    rows.append(row + j)
                if j == len(draft):
                    break
                token = draft[j]
                if not governs:
                    self.accept(token)  # free (before the trigger) or terminated: no step
                    continue
                if not _allowed(bitmask, row + j, token) or not self.matcher.accept_token(token):
                    allowed = j
                    break
                steps += 1
        finally:
            if steps:
                self.matcher.rollback(steps)
            self.active = active
        return allowed, rows

    def fill_after(self, bitmask: torch.Tensor, row: int, tokens: list[int]) -> bool:
        """The matcher steps along `tokens` as `accept` would, fills, then rolls back."""
        active, steps = self.active, 0
        try:
            for token in tokens:
                if not self.active or self.matcher.is_terminated():
                    self.accept(token)  # free (before the trigger) or terminated: no step
                    continue
                if not self.matcher.accept_token(token):
                    return False
                steps += 1
            return self.fill(bitmask, row)
        finally:
            if steps:
                self.matcher.rollback(steps)
            self.active = active

    def accept(self, token: int) -> None:
        if not self.active:
            self.active = token == self.trigger
        elif not self.matcher.is_terminated():
            self.matcher.accept_token(token)


def _allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    """Whether bitmask[row] allows `token` (checked first: a matcher logs each token it rejects)."""
    if token >> 5 >= bitmask.shape[1]:
        return False
    return bool(int(bitmask[row, token >> 5]) >> (token & 31) & 1)


def allocate_bitmask(rows: int, vocab: int) -> torch.Tensor:
    """int32 [rows, ceil(vocab/32)], every token allowed."""
    import xgrammar as xgr

    return xgr.allocate_token_bitmask(rows, vocab)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Sets the logits of disallowed tokens to -inf in the given rows (in place)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)

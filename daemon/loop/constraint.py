"""Constrained decoding with xgrammar: a per-request grammar matcher that masks the logits of
its row each step and is advanced with each sampled token."""

from __future__ import annotations

from typing import Protocol

import torch
import xgrammar as xgr


class Constraint(Protocol):
    """A request's constrained decoding, stateful: masks its logits row before each sample
    and sees each sampled token (SamplingParams.constraint)."""

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into bitmask[row]; False when unconstrained now."""
        ...

    def accept(self, token: int) -> None: ...


class GrammarConstraint:
    """One request's matcher. With `trigger` set (the end-of-thinking token), output is free
    until that token is sampled; the grammar governs everything after it."""

    def __init__(self, compiled: xgr.CompiledGrammar, trigger: int | None = None) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.trigger = trigger
        self.active = trigger is None

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Writes the allowed next tokens into bitmask[row]; False when unconstrained now."""
        if not self.active or self.matcher.is_terminated():
            return False
        self.matcher.fill_next_token_bitmask(bitmask, row)
        return True

    def accept(self, token: int) -> None:
        if not self.active:
            self.active = token == self.trigger
        elif not self.matcher.is_terminated():
            self.matcher.accept_token(token)


def allocate_bitmask(rows: int, vocab: int) -> torch.Tensor:
    """int32 [rows, ceil(vocab/32)], every token allowed."""
    return xgr.allocate_token_bitmask(rows, vocab)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Sets the logits of disallowed tokens to -inf in the given rows (in place)."""
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)

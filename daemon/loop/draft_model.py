"""A separate draft model (`--draft-model`) as the runner's draft network: every step it runs the
target's forward rows through its own cache, then drafts from its logits (loop/early_exit.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from daemon.models.base import AttentionMetadata, Model, ModelCache


@dataclass
class DraftModel:
    """A small model with the target's tokenizer over a cache of its own, allocated with the
    target's paged geometry (as many blocks, the same block size): the target's block tables
    and attention metadata index it. `mirror` runs every step's rows through it, so its KV
    holds every token the target's does; a verify's rejected rows are written again before
    they are read, as in the target's cache.

    Blocks the prefix cache brings back from the host tier or the block store hold only the
    target's KV (the copies move the target's blocks): the draft's KV at those positions is
    whatever its block held before. That lowers acceptance for such requests, never the output
    (the target verifies every draft)."""

    model: Model
    draft_cache: ModelCache

    @property
    def cache(self) -> ModelCache:
        return self.draft_cache

    def mirror(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionMetadata,
        hidden: torch.Tensor,
    ) -> None:
        """The step's rows through every layer, for their KV (the outputs are not needed)."""
        self.model(input_ids, positions, attention, self.draft_cache)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionMetadata,
        context: torch.Tensor,
    ) -> torch.Tensor:
        """Drafts from tokens alone: `context` is not used."""
        return self.model(input_ids, positions, attention, self.draft_cache)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

"""Moves whole prefix blocks between the device KV pools and host memory.

A prefix block is one block in every paged group; its payload is the bytes of that block's
row in each of the cache's per-block tensors, concatenated in a fixed order.
"""

from __future__ import annotations

import torch


class BlockCopier:
    def __init__(self, views: list[list[torch.Tensor]]) -> None:
        """views[g]: the cache tensors of paged group g, each indexed by block on dim 0."""
        self.views = views
        self.row_bytes = [[v[0].numel() * v.element_size() for v in group] for group in views]
        self.block_bytes = sum(sum(group) for group in self.row_bytes)

    def gather(self, blocks: list[list[int]]) -> list[torch.Tensor]:
        """blocks[k][g] = key k's block in group g -> one CPU uint8 payload per key."""
        if not blocks:
            return []
        n = len(blocks)
        parts = []
        for g, group in enumerate(self.views):
            idx = torch.tensor([b[g] for b in blocks], dtype=torch.long, device=group[0].device)
            parts.extend(v.index_select(0, idx).reshape(n, -1).view(torch.uint8) for v in group)
        rows = torch.cat(parts, dim=1).to("cpu")
        return [row.clone() for row in rows] if n > 1 else [rows[0]]

    def scatter(self, blocks: list[list[int]], payloads: list[torch.Tensor]) -> None:
        """Write payloads (as made by gather) into the given blocks."""
        if not blocks:
            return
        device = self.views[0][0].device
        rows = torch.stack(payloads).to(device)
        offset = 0
        for g, group in enumerate(self.views):
            idx = torch.tensor([b[g] for b in blocks], dtype=torch.long, device=device)
            for v, nbytes in zip(group, self.row_bytes[g]):
                part = rows[:, offset : offset + nbytes].contiguous().view(v.dtype)
                v.index_copy_(0, idx, part.view(len(blocks), *v.shape[1:]))
                offset += nbytes

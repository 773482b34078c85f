"""A request's paged blocks copied out of a cache and into another's: the block half of
`ModelCache.export_kv` / `import_kv`, shared by every model's cache."""

from __future__ import annotations

import torch

from daemon.models.base import ModelCache


def covering(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The blocks of `table` that hold positions [start, end) (`start` on a block boundary)."""
    if start % block_size:
        raise ValueError(f"start {start} is not a multiple of the block size {block_size}")
    return table[start // block_size : -(-end // block_size)]


def export_blocks(
    cache: ModelCache,
    groups: list[int],
    tables: list[list[int]],
    start: int,
    end: int,
    block_size: int,
) -> dict[int, list[torch.Tensor]]:
    """Each paged group's block views, rows of the blocks covering [start, end), on the host."""
    out = {}
    for group in groups:
        views = cache.block_views(group)
        index = torch.tensor(covering(tables[group], start, end, block_size), dtype=torch.long)
        index = index.to(views[0].device)
        out[group] = [view.index_select(0, index).to("cpu") for view in views]
    return out


def import_blocks(
    cache: ModelCache,
    blocks: dict[int, list[torch.Tensor]],
    tables: list[list[int]],
    start: int,
    end: int,
    block_size: int,
) -> None:
    """`export_blocks`' rows written into the blocks covering [start, end) of `tables`."""
    for group, rows in blocks.items():
        views = cache.block_views(group)
        index = torch.tensor(covering(tables[group], start, end, block_size), dtype=torch.long)
        if len(rows) != len(views) or rows[0].shape[0] != index.numel():
            raise ValueError(f"group {group}: the export does not fit this request's blocks")
        index = index.to(views[0].device)
        for view, part in zip(views, rows):
            view.index_copy_(0, index, part.to(view.device, view.dtype))

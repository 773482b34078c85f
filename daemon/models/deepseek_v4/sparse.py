"""The arithmetic of V4's sparse attention, in plain torch.

A query's keys come in parts: its sliding window, its compressed entries (all the visible
ones, or the indexer's top-k) and a learned per-head sink logit. One softmax spans them all
without concatenating anything: each part's logits are exponentiated in place against the
common row maximum (the sink included), and the parts' value products are summed and divided
by the common denominator. Keys are also the values (shared-KV MQA).

The window part of a chunk of n queries runs in tiles of T queries: a tile sees the T + W - 1
keys ending at its last query, so the chunk costs O(n (T + W)) instead of O(n (n + W)); with
small tiles (T = 16) little of that is masked. The chunks of a step run together, each padded
to the longest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

NEG_INF = float("-inf")
WINDOW_TILE = 16  # queries per window tile: each sees tile + W - 1 keys, W of them unmasked


def gather_rows(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """table[rows] for a row table [N, ...] and any shape of rows (index_select: on CPU many
    times faster than advanced indexing)."""
    return table.index_select(0, rows.flatten()).view(*rows.shape, *table.shape[1:])


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of torch.topk(scores, k) along the last dim, in no order: [..., E] -> [..., k].

    Long rows go in two cheaper rounds: entry e is dealt to group e % G (G = E // size); the
    k groups with the largest maxima hold all of the k largest entries (an entry of any other
    group is below k group maxima), so the second round ranks only their k * size entries.
    Equal to torch.topk's choice up to ties."""
    e = scores.shape[-1]
    size = math.isqrt(e // k)  # balances the two rounds: E / size groups, k * size candidates
    if size < 4:
        return scores.topk(k, dim=-1, sorted=False).indices
    groups = e // size
    whole = groups * size
    lead = scores[..., :whole].unflatten(-1, (size, groups))
    best = lead.amax(dim=-2).topk(k, dim=-1, sorted=False).indices
    candidates = lead.gather(-1, best.unsqueeze(-2).expand(*lead.shape[:-1], k)).flatten(-2)
    offsets = torch.arange(0, whole, groups, device=scores.device)[:, None]
    index = (best.unsqueeze(-2) + offsets).flatten(-2)
    if whole < e:  # the last E % size entries are candidates of their own
        candidates = torch.cat((candidates, scores[..., whole:]), dim=-1)
        tail = torch.arange(whole, e, device=scores.device).expand(*index.shape[:-1], -1)
        index = torch.cat((index, tail), dim=-1)
    return index.gather(-1, candidates.topk(k, dim=-1, sorted=False).indices)


def part_logits(q: torch.Tensor, keys: torch.Tensor, blocked: torch.Tensor | None) -> torch.Tensor:
    """q [N, H, D] with keys [L, D] (shared by all queries) or [N, L, D] (per query) ->
    float logits [N, H, L], -inf where `blocked` ([N, 1, L] or broadcastable) is True."""
    logits = torch.matmul(q, keys.transpose(-1, -2)).float()
    if blocked is not None:
        logits.masked_fill_(blocked, NEG_INF)
    return logits


def part_values(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The unnormalised output of one part: probs [N, H, L] times its keys -> [N, H, D]."""
    return torch.matmul(probs.to(keys.dtype), keys)


def sink_softmax_(logits: list[torch.Tensor], sinks: torch.Tensor) -> torch.Tensor:
    """Turn each part's logits [N, H, L_i] (L_i > 0) into exp(logit - max) in place, the max
    taken over every part and the per-head sink logit [H]; returns 1 / the softmax denominator
    [N, H, 1] (whose sum includes the sink)."""
    top = sinks.expand(logits[0].shape[:-1])
    for part in logits:
        top = torch.maximum(top, part.amax(dim=-1))
    total = (sinks - top).exp_()
    top = top.unsqueeze(-1)
    for part in logits:
        total += part.sub_(top).exp_().sum(dim=-1)
    return total.reciprocal_().unsqueeze(-1)


@dataclass
class WindowTiles:
    """The sliding-window keys of R chunks laid out for tiles of `tile` queries.

    keys: [R, W - 1 + padded, D]: per chunk the W - 1 positions before it (its first `missing`
    rows have no KV: before position 0 or the replay floor), then its own keys, padded to whole
    tiles. Tile i holds queries [i * tile, (i + 1) * tile) and key rows [i * tile, i * tile +
    tile + W - 1); query j of a tile sees tile rows j .. j + W - 1, so padded key rows are seen
    only by padded queries.
    """

    keys: torch.Tensor
    missing: torch.Tensor  # [R]
    window: int
    heads: int
    tile: int = WINDOW_TILE

    @property
    def width(self) -> int:
        return self.tile + self.window - 1

    def _tiles(self, chunks: slice, tiles: slice) -> torch.Tensor:
        """Keys of the given tiles of the given chunks, transposed: [r, t, D, width]."""
        return self.keys[chunks].unfold(1, self.width, self.tile)[:, tiles]

    def logits(self, q: torch.Tensor, chunks: slice, tiles: slice) -> torch.Tensor:
        """q: those tiles' queries [r, t * tile, H, D] -> float logits [r * t * tile, H,
        width], -inf outside each query's window."""
        keys = self._tiles(chunks, tiles)
        r, t, _, width = keys.shape
        logits = torch.matmul(q.reshape(r, t, self.tile * self.heads, -1), keys)
        logits = logits.float().view(r, t, self.tile, self.heads, width)
        device = q.device
        offset = (
            torch.arange(width, device=device) - torch.arange(self.tile, device=device)[:, None]
        )
        blocked = ((offset < 0) | (offset >= self.window))[:, None, :]  # [tile, 1, width]
        first = torch.arange(tiles.start, tiles.start + t, device=device)[:, None] * self.tile
        absent = first + torch.arange(width, device=device) < self.missing[chunks, None, None]
        blocked = blocked | absent[:, :, None, None, :]  # [r, t, tile, 1, width]
        return logits.masked_fill_(blocked, NEG_INF).view(r * t * self.tile, self.heads, width)

    def values(self, probs: torch.Tensor, chunks: slice, tiles: slice) -> torch.Tensor:
        """probs: logits() after sink_softmax_ -> unnormalised outputs [r * t * tile, H, D]."""
        keys = self._tiles(chunks, tiles).transpose(-1, -2)
        r, t, width, _ = keys.shape
        probs = probs.to(keys.dtype).view(r, t, self.tile * self.heads, width)
        return torch.matmul(probs, keys).view(r * t * self.tile, self.heads, -1)


class SharedInputLinears:
    """Bias-free linears of the same input run as one matmul: (x) -> each one's output, as
    column views of one product. The modules keep their parameters and names (checkpoints load
    as before); on first use their weights become views of one concatenated matrix, rebuilt
    whenever one of them has been given other storage since (to_empty, a reload)."""

    def __init__(self, *linears: nn.Linear) -> None:
        self.linears = linears
        self.widths = [linear.out_features for linear in linears]
        self.weight: torch.Tensor | None = None
        self.storage: tuple[int, ...] = ()

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if tuple(linear.weight.data_ptr() for linear in self.linears) != self.storage:
            self._fuse()
        return F.linear(x, self.weight).split(self.widths, dim=-1)

    def _fuse(self) -> None:
        with torch.inference_mode(False):  # a plain tensor: the parameters stay usable anywhere
            fused = torch.cat([linear.weight.detach() for linear in self.linears])
        for linear, part in zip(self.linears, fused.split(self.widths)):
            linear.weight.data = part
        self.weight = fused
        self.storage = tuple(linear.weight.data_ptr() for linear in self.linears)

"""CUDA graphs for decode-only steps: the bucket helpers and the capture, shared; the
paged-attention (dense) models' graphs. DeepSeek-V4's are in `deepseek_v4/graphs.py`."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch
from torch import nn

from daemon.models.attention import AttentionBatch, PagedKVCache
from daemon.models.base import AttentionMetadata

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def batch_buckets(max_batch: int) -> list[int]:
    """Graph batch sizes up to `max_batch` (which is always one)."""
    return [b for b in BATCH_SIZES if b < max_batch] + [max_batch]


def bucket(value: int, buckets: list[int]) -> int | None:
    """The smallest bucket ≥ value; None above the largest."""
    i = bisect.bisect_left(buckets, value)
    return buckets[i] if i < len(buckets) else None


def width_buckets(max_blocks: int) -> list[int]:
    """KV widths in blocks: powers of two, then `max_blocks` itself."""
    out, width = [], 1
    while width < max_blocks:
        out.append(width)
        width *= 2
    return out + [max_blocks]


class GraphInputs(Protocol):
    """The static buffers one graph reads."""

    input_ids: torch.Tensor
    positions: torch.Tensor

    def attention(self) -> AttentionMetadata:
        """Attention metadata over these buffers, fresh for each forward."""
        ...


Inputs = TypeVar("Inputs", bound=GraphInputs)
Cache = TypeVar("Cache")


@dataclass
class Captured(Generic[Inputs]):
    replay: Callable[[], None]
    inputs: Inputs  # the static buffers it was captured on
    hidden: torch.Tensor  # the forward's output [B, ...]: valid until the next replay


class CapturedGraphs(Generic[Inputs, Cache]):
    """Graphs over one cache, captured lazily on the first step of each key, each on its own
    static `Inputs`; call from the device thread.

    A small model's eager forward is bound by kernel launches from Python, which also hold the
    GIL the event loop needs; a replay is one launch, so the device works while the loop
    schedules. Padded rows write their KV (V4: all their state) to scratch rows that no block
    table references."""

    def __init__(self, model: nn.Module, cache: Cache, device: torch.device) -> None:
        self.model, self.cache, self.device = model, cache, device
        self.graphs: dict[Hashable, Captured[Inputs]] = {}
        self.pool: tuple[int, int] | None = None

    def warm_up(self) -> None:
        """Nothing ahead: a graph is captured on the first step of its key, in milliseconds."""

    def _replay(
        self,
        key: Hashable,
        allocate: Callable[[], Inputs],
        fill: Callable[[Inputs], None],
        rows: int,
    ) -> torch.Tensor:
        """Replay the graph of `key` (captured first on `allocate()`'s buffers) after `fill`
        put the step's inputs into its buffers; its first `rows` rows of output."""
        captured = self.graphs.get(key)
        if captured is None:
            inputs = allocate()
            replay, hidden = self.record(inputs)
            captured = self.graphs[key] = Captured(replay, inputs, hidden)
        fill(captured.inputs)
        captured.replay()
        return captured.hidden[:rows]

    def record(self, inputs: GraphInputs) -> tuple[Callable[[], None], torch.Tensor]:
        """The forward on `inputs` captured as a CUDA graph: (its replay, its output). Each
        forward gets its own `inputs.attention()`: a model may cache per-step tables in it."""
        # one eager run on a side stream first: lazy initialisation must not be captured
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.model(inputs.input_ids, inputs.positions, inputs.attention(), self.cache)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.attention(), self.cache)
        self.pool = graph.pool()
        return graph.replay, hidden


@dataclass
class StaticInputs:
    """The buffers one paged-attention graph reads. Padded rows write their KV to the scratch
    slot and attend one position (block 0's first, only read) so that their softmax stays
    finite."""

    input_ids: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    slot_mapping: torch.Tensor  # [B]
    tables: torch.Tensor  # [B, blocks]
    mask: torch.Tensor  # [B, 1, 1, blocks * block_size]
    block_size: int
    scratch: int  # the KV slot padded rows write to

    @classmethod
    def allocate(
        cls, batch: int, blocks: int, block_size: int, scratch: int, device: torch.device
    ) -> StaticInputs:
        long = dict(dtype=torch.long, device=device)
        mask = torch.zeros(batch, 1, 1, blocks * block_size, dtype=torch.bool, device=device)
        mask[..., 0] = True
        return cls(
            input_ids=torch.zeros(batch, **long),
            positions=torch.zeros(batch, **long),
            slot_mapping=torch.full((batch,), scratch, **long),
            tables=torch.zeros(batch, blocks, **long),
            mask=mask,
            block_size=block_size,
            scratch=scratch,
        )

    def attention(self) -> AttentionBatch:
        return AttentionBatch(
            self.slot_mapping, self.tables.shape[0], self.tables, self.mask, [], self.block_size
        )

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> None:
        n, blocks = batch.num_decodes, batch.decode_tables.shape[1]
        width = blocks * self.block_size
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.slot_mapping[n:].fill_(self.scratch)
        self.tables[:n, :blocks].copy_(batch.decode_tables)
        self.tables[:n, blocks:].zero_()
        self.mask[:n, ..., :width].copy_(batch.decode_mask)
        self.mask[:n, ..., width:].zero_()
        self.mask[n:].zero_()
        self.mask[n:, ..., 0] = True


class PagedDecodeGraphs(CapturedGraphs[StaticInputs, PagedKVCache]):
    """Paged-attention decode graphs, keyed by (batch, KV width in blocks) buckets."""

    def __init__(
        self, model: nn.Module, cache: PagedKVCache, device: torch.device, max_batch: int
    ) -> None:
        super().__init__(model, cache, device)
        self.batches = batch_buckets(max_batch)
        self.widths = width_buckets(-(-model.max_model_len // cache.block_size))

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor | None:
        """The hidden states [B, hidden] of a decode-only step by graph replay; None when the
        step has prefill chunks or falls outside every bucket (run it eagerly)."""
        n = batch.num_decodes
        if batch.prefills or n == 0 or n != input_ids.shape[0]:
            return None
        size = bucket(n, self.batches)
        width = bucket(batch.decode_tables.shape[1], self.widths)
        if size is None or width is None:
            return None
        return self._replay(
            (size, width),
            lambda: StaticInputs.allocate(
                size, width, self.cache.block_size, self.cache.scratch_slot, self.device
            ),
            lambda inputs: inputs.fill(input_ids, positions, batch),
            n,
        )

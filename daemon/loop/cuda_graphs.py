"""CUDA graphs for decode-only steps: one captured forward per bucket of shapes, replayed after
the step's inputs are copied into its static buffers. Paged-attention models: (batch, KV width)
buckets; DeepSeek-V4: (batch, context positions) buckets, the step's metadata already padded to
them on the host.

A small model's eager forward is bound by kernel launches from Python, which also hold the GIL
the event loop needs; a replay is one launch, so the device works while the loop schedules.
Padded rows write their KV (V4: all their state) to scratch rows that no block table references.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from daemon.models.attention import AttentionBatch, PagedKVCache
from daemon.models.deepseek_v4.cache import DecodeShape, V4Batch, V4Cache, V4Decodes

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


def position_buckets(block_tokens: int, max_len: int) -> list[int]:
    """V4 context buckets: `block_tokens` times powers of two, up to `max_len` rounded up to
    whole blocks (compressed entry counts, positions // rate, are then whole numbers)."""
    return [block_tokens * w for w in width_buckets(-(-max_len // block_tokens))]


@dataclass
class StaticInputs:
    """The buffers one graph reads. Padded rows write their KV to the scratch slot and attend
    one position (block 0's first, only read) so that their softmax stays finite."""

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


@dataclass
class Captured:
    replay: Callable[[], None]
    inputs: StaticInputs | V4StaticInputs
    hidden: torch.Tensor  # the forward's output [B, hidden]: valid until the next replay


class DecodeGraphs:
    """Captures lazily, on the first step of each bucket; call from the device thread."""

    def __init__(
        self, model: nn.Module, cache: PagedKVCache, device: torch.device, max_batch: int
    ) -> None:
        self.model, self.cache, self.device = model, cache, device
        self.batches = batch_buckets(max_batch)
        self.widths = width_buckets(-(-model.max_model_len // cache.block_size))
        self.graphs: dict[Any, Captured] = {}
        self.pool: tuple[int, int] | None = None

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

    def _replay(
        self,
        key: Any,
        allocate: Callable[[], StaticInputs | V4StaticInputs],
        fill: Callable[[Any], None],
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

    def record(
        self, inputs: StaticInputs | V4StaticInputs
    ) -> tuple[Callable[[], None], torch.Tensor]:
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
class V4StaticInputs:
    """The buffers one DeepSeek-V4 graph reads: token ids, positions and the padded decode
    metadata. Allocated with every row idle, so the capture's warm-up run writes only to the
    scratch rows."""

    input_ids: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    counted: torch.Tensor  # [B] 1 for the step's rows, 0 for idle ones
    decodes: V4Decodes
    shape: DecodeShape

    @classmethod
    def allocate(cls, shape: DecodeShape, cache: V4Cache, device: torch.device) -> V4StaticInputs:
        long = dict(dtype=torch.long, device=device)
        return cls(
            input_ids=torch.zeros(shape.batch, **long),
            positions=torch.zeros(shape.batch, **long),
            counted=torch.zeros(shape.batch, **long),
            decodes=cache.idle_decodes(shape).to(device).buffers(),
            shape=shape,
        )

    def attention(self) -> V4Batch:
        return V4Batch(decodes=self.decodes.fresh(), shape=self.shape, counted=self.counted)

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: V4Batch) -> None:
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:].zero_()
        self.counted[:n].fill_(1)
        self.counted[n:].zero_()
        self.decodes.fill(batch.decodes)


@dataclass(frozen=True)
class V4Buckets:
    """The V4 graphs' shapes: a decode-only step of `decodes` requests whose positions are
    below `context` fits the smallest batch and context buckets that hold it."""

    batches: list[int]
    positions: list[int]

    def __call__(self, decodes: int, context: int) -> DecodeShape | None:
        batch, positions = bucket(decodes, self.batches), bucket(context, self.positions)
        return None if batch is None or positions is None else DecodeShape(batch, positions)


class V4DecodeGraphs(DecodeGraphs):
    """DeepSeek-V4 decode graphs: keyed by the shape the cache padded the step's decodes to
    (it pads once these graphs give it their buckets)."""

    def __init__(
        self, model: nn.Module, cache: V4Cache, device: torch.device, max_batch: int
    ) -> None:
        self.model, self.cache, self.device = model, cache, device
        self.graphs: dict[Any, Captured] = {}
        self.pool: tuple[int, int] | None = None
        cache.decode_shape = V4Buckets(
            batch_buckets(max_batch), position_buckets(cache.cfg.block_tokens, model.max_model_len)
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: V4Batch
    ) -> torch.Tensor | None:
        if batch.shape is None:
            return None
        return self._replay(
            batch.shape,
            lambda: V4StaticInputs.allocate(batch.shape, self.cache, self.device),
            lambda inputs: inputs.fill(input_ids, positions, batch),
            input_ids.shape[0],
        )

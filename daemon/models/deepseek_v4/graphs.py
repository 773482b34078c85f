"""DeepSeek-V4 decode graphs: (batch, context positions) buckets, the step's decode metadata
padded to them on the host (idle rows write all their state to scratch rows)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from daemon.models.deepseek_v4.batch import DecodeShape, V4Batch, V4Decodes
from daemon.models.deepseek_v4.cache import V4Cache
from daemon.models.graphs import CapturedGraphs, batch_buckets, bucket, width_buckets


def position_buckets(block_tokens: int, max_len: int) -> list[int]:
    """V4 context buckets: `block_tokens` times powers of two, up to `max_len` rounded up to
    whole blocks (compressed entry counts, positions // rate, are then whole numbers)."""
    return [block_tokens * w for w in width_buckets(-(-max_len // block_tokens))]


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

    @classmethod
    def up_to(cls, max_batch: int, block_tokens: int, max_len: int) -> V4Buckets:
        return cls(batch_buckets(max_batch), position_buckets(block_tokens, max_len))

    def __call__(self, decodes: int, context: int) -> DecodeShape | None:
        batch, positions = bucket(decodes, self.batches), bucket(context, self.positions)
        return None if batch is None or positions is None else DecodeShape(batch, positions)


class V4DecodeGraphs(CapturedGraphs[V4StaticInputs, V4Cache]):
    """DeepSeek-V4 decode graphs: keyed by the shape the cache padded the step's decodes to
    (a cache built with the graphs' `V4Buckets` as its decode shapes)."""

    def __init__(self, model: nn.Module, cache: V4Cache, device: torch.device) -> None:
        if cache.decode_shape is None:
            raise ValueError("V4 decode graphs need a cache that pads decodes to their shapes")
        super().__init__(model, cache, device)

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

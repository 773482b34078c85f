"""Per-layer KV specs, one class per kind: what one block of a layer group holds, and whether a
request holds one block per `block_size` tokens (paged) or one block whatever its length."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class KVSpec(ABC):
    """Base spec: `block_size` token positions per block, for `num_layers` layers."""

    # True for fixed-size per-request state (one block each, whatever the length); the kind
    # managers, the runner and the benches all read it here
    per_request: ClassVar[bool] = False

    block_size: int
    num_layers: int
    dtype: torch.dtype

    @property
    @abstractmethod
    def bytes_per_block(self) -> int: ...

    @property
    @abstractmethod
    def name(self) -> str:
        """The kind's label (what /metrics and the logs call the group)."""


@dataclass(frozen=True)
class SizedBlocks:
    """A spec whose model gives the block size in bytes and the kind's label (`name`)."""

    label: str
    block_bytes: int

    @property
    def bytes_per_block(self) -> int:
        return self.block_bytes

    @property
    def name(self) -> str:
        return self.label


@dataclass(frozen=True)
class PagedSpec(KVSpec, ABC):
    """One block per `block_size` positions; full blocks can be shared through the prefix cache."""


@dataclass(frozen=True)
class PerRequestSpec(SizedBlocks, KVSpec, ABC):
    """One block per running request, whatever its length, sized in bytes by the model."""

    per_request: ClassVar[bool] = True


@dataclass(frozen=True)
class FullAttentionSpec(PagedSpec):
    """Paged K and V for every position: the dense-model case."""

    num_kv_heads: int
    head_dim: int

    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize * self.num_layers

    @property
    def name(self) -> str:
        return "full"


@dataclass(frozen=True)
class CompressedKVSpec(SizedBlocks, PagedSpec):
    """Paged compressed entries (DeepSeek-V4's CSA and HCA): `block_bytes` per block of
    `block_size` positions, whatever the compression inside."""


@dataclass(frozen=True)
class SlidingWindowSpec(PerRequestSpec):
    """A ring of the last window's raw KV per request; the prefix cache snapshots it at block
    boundaries (kv/swa_cache.py), since a shared prefix's blocks do not hold it."""


@dataclass(frozen=True)
class CompressorStateSpec(PerRequestSpec):
    """Per-request compressor buffers (open windows, overlap state)."""


@dataclass(frozen=True)
class KVGroup:
    """Layers that share one spec, one pool and one block table per request. A model declares
    its layers as such groups; the KV manager gives each its own pool, block tables and kind
    manager (kv/kinds.py), so a hybrid model adds a spec class, not a manager."""

    spec: KVSpec
    layer_ids: tuple[int, ...]

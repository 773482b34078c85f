"""Per-layer KV specs: what one block of a layer group holds and how many a request needs.

A model declares its layers as groups that share a spec; the manager gives each
group its own pool and block tables, so a hybrid model adds a spec, not a manager.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVSpec(ABC):
    """Base spec: `block_size` token positions per block, for `num_layers` layers."""

    block_size: int
    num_layers: int
    dtype: torch.dtype

    @property
    @abstractmethod
    def bytes_per_block(self) -> int: ...

    @property
    def per_request(self) -> bool:
        """True for fixed-size per-request state (one block each, whatever the length)."""
        return False

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a request holds once its sequence is `num_tokens` long."""
        if self.per_request:
            return 1 if num_tokens > 0 else 0
        return math.ceil(num_tokens / self.block_size)


@dataclass(frozen=True)
class FullAttentionSpec(KVSpec):
    """Paged K and V for every position: the dense-model case."""

    num_kv_heads: int
    head_dim: int

    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize * self.num_layers


@dataclass(frozen=True)
class StateSpec(KVSpec):
    """Fixed-size state a model keeps per request or per block, given in bytes.

    `per_request=True`: one block per running request (a sliding-window ring,
    compressor buffers). Otherwise paged: one block per `block_size` tokens
    (compressed entries).
    """

    name: str
    block_bytes: int
    is_per_request: bool

    @property
    def bytes_per_block(self) -> int:
        return self.block_bytes

    @property
    def per_request(self) -> bool:
        return self.is_per_request


@dataclass(frozen=True)
class KVGroup:
    """Layers that share one spec, one pool and one block table per request."""

    spec: KVSpec
    layer_ids: tuple[int, ...]

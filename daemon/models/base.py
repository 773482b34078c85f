"""The model interface the engine drives: a model over a prepared batch, its device cache and
the per-request state operations on that cache (rollback, transfer), as typed contracts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from daemon.kv.spec import KVGroup

if TYPE_CHECKING:
    from daemon.kv.tier_ops import RestoreOp


@dataclass
class SeqSlice:
    """One sequence's part of a step, as the runner hands it to a model's cache."""

    q_start: int  # first row of the flat token batch
    start: int  # first position computed
    num_tokens: int
    block_tables: list[list[int]]  # one per KV group
    is_decode: bool
    replay: bool = False
    window_floor: int = 0  # replay: no raw KV below this position is used


@dataclass
class RequestState:
    """A request's per-request state (beyond its paged blocks) after its first `position`
    tokens: the model's own tensors, in an order only its cache reads. Empty for a model whose
    whole state is in paged blocks."""

    position: int
    tensors: list[torch.Tensor] = field(default_factory=list)

    def to(self, device: torch.device | str) -> RequestState:
        return RequestState(self.position, [t.to(device, copy=True) for t in self.tensors])


@dataclass
class KVExport:
    """A request's KV state for tokens [start, end), as plain CPU tensors: for each paged group
    (by group index) the rows of every block view for the blocks covering the range, block by
    block; and the per-request state at `end`."""

    start: int
    end: int
    blocks: dict[int, list[torch.Tensor]]  # group -> one [blocks, ...] tensor per block view
    state: RequestState


class AttentionMetadata(Protocol):
    """A step's attention metadata, built on the host by `ModelCache.build_attention`; opaque to
    the engine but for moving it to the device (asynchronously where it can)."""

    def to(self, device: torch.device) -> AttentionMetadata: ...


class ModelCache(Protocol):
    """A model's KV storage on the device, one pool per KV group (as `Model.kv_groups` declared
    them), indexed by the blocks the engine's KV manager hands out.

    Per-request state operations (speculative rollback, prefill/decode transfer): `tables` are
    the request's block tables, one per group, as the manager holds them. The caller runs them
    on the device thread, between steps, when the cache holds exactly the request's first
    `position` (snapshot) or `end` (export) tokens."""

    def build_attention(self, seqs: list[SeqSlice]) -> AttentionMetadata:
        """The metadata of one step's flat token batch (host tensors), sequences in row order."""
        ...

    def block_views(self, group: int) -> list[torch.Tensor]:
        """Every tensor of paged group `group`, indexed by the pool's blocks on dim 0."""
        ...

    def snapshot(self, tables: list[list[int]], position: int) -> RequestState:
        """The request's per-request state after its first `position` tokens, copied on the
        device: what `restore_state` needs to undo any steps that follow (rejected draft
        tokens). Paged blocks are not copied: rows past `position` are not read before they
        are written again."""
        ...

    def restore_state(self, state: RequestState, tables: list[list[int]]) -> None:
        """Put a snapshot (or an imported state) into the request's per-request blocks: its next
        step then continues from `state.position` as if nothing had run since."""
        ...

    def export_kv(self, tables: list[list[int]], start: int, end: int) -> KVExport:
        """The request's KV for [start, end) on the host: `start` a multiple of the paged block
        size, `end` the request's computed length (its last block may be partly filled)."""
        ...

    def import_kv(self, export: KVExport, tables: list[list[int]]) -> None:
        """Write an export (from a cache of the same model and block size) into this request's
        blocks: its next step continues at `export.end` as on the exporting cache."""
        ...


class SlidingWindowCache(ModelCache, Protocol):
    """The cache of a model with a sliding-window group ("swa"): what the prefix cache needs to
    resume a request at a block boundary. The prefix cache makes sliding-window saves and
    restores only for such a model."""

    @property
    def swa_snapshot_bytes(self) -> int:
        """Host bytes of one `save_swa` snapshot."""
        ...

    @property
    def replay_tokens(self) -> int:
        """Tokens a replay recomputes before a boundary to rebuild its window exactly."""
        ...

    def save_swa(self, swa_block: int, position: int) -> torch.Tensor:
        """The window's raw KV before `position` (ring `swa_block`), every layer, on the host."""
        ...

    def restore(self, op: RestoreOp, tables: list[list[int]]) -> None:
        """Before a resumed request's first step: its per-request state at the block boundary
        `op.position` (the window from `op.snapshot` if there is one)."""
        ...


class DecodeGraphs(Protocol):
    """Captured decode forwards (CUDA graphs) or compiled ones (a CPU), run on the device
    thread."""

    def warm_up(self) -> None:
        """Make what the common steps need ahead of them (at engine start)."""
        ...

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionMetadata
    ) -> torch.Tensor | None:
        """The forward's output for a decode step by replay; None when no graph fits the step
        (the caller runs it eagerly)."""
        ...


class Model(Protocol):
    """A causal LM over the engine's flat token batch."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    def kv_groups(self, dtype: torch.dtype, block_size: int) -> list[KVGroup]:
        """The KV groups the model needs (`block_size`: the paged block size asked for, which a
        model with its own block geometry may ignore)."""
        ...

    def allocate_cache(
        self,
        groups: list[KVGroup],
        num_blocks: list[int],
        device: torch.device,
        graph_batch: int = 0,
    ) -> ModelCache:
        """Storage for `num_blocks[i]` blocks of each group of `kv_groups`. `graph_batch`: the
        `max_batch` of the decode graphs to be made over it (0: none), for a cache that pads
        decode steps to the graphs' shapes."""
        ...

    def decode_graphs(
        self, cache: ModelCache, device: torch.device, max_batch: int
    ) -> DecodeGraphs | None:
        """Decode graphs over `cache` (built with `graph_batch` = `max_batch`) for up to
        `max_batch` sequences; None: the model has none."""
        ...

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionMetadata,
        cache: ModelCache,
    ) -> torch.Tensor:
        """The forward over a prepared batch: a hidden row for every token (writes its KV)."""
        ...

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """fp32 logits [N, vocab] of the forward's rows `hidden` (chosen rows only); with
        `upcast` False, in the model's own dtype where the head computes them in it (greedy
        rows need no fp32 copy)."""
        ...


@runtime_checkable
class EarlyExitModel(Protocol):
    """An optional capability of a `Model`: a forward through its first layers only, for drafts
    from the model itself (layer skipping). It writes the KV of those layers alone, so it suits
    a model whose whole state is in paged blocks (dense): a full forward over the same
    positions overwrites them. A model with per-request state (DeepSeek-V4) has none."""

    @property
    def num_layers(self) -> int: ...

    def forward_layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionMetadata,
        cache: ModelCache,
        num_layers: int,
    ) -> torch.Tensor:
        """The hidden rows after the first `num_layers` layers and the final norm (so that
        `compute_logits` applies); writes those layers' KV at `positions`."""
        ...


@runtime_checkable
class VisionLanguageModel(Protocol):
    """An optional capability of a `Model`: images encoded into embeddings that replace the
    token embeddings of their placeholders (`image_tokens` of `image_token_id` per image)."""

    @property
    def image_token_id(self) -> int: ...

    @property
    def image_tokens(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, image_tokens, hidden] embeddings of preprocessed images [images, 3, H, W]."""
        ...

    def forward_spliced(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionMetadata,
        cache: ModelCache,
        rows: torch.Tensor,
        embeds: torch.Tensor,
    ) -> torch.Tensor:
        """The forward with the input embeddings of batch rows `rows` replaced by `embeds`."""
        ...

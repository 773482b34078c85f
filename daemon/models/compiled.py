"""The CPU counterpart of the CUDA decode graphs: the dense decoder layer compiled by inductor
(C++/OpenMP) once for all layers, dynamic in batch and KV width, its artifacts cached on disk."""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from daemon.models.attention import AttentionBatch, PagedKVCache

log = structlog.get_logger(__name__)

MIN_WIDTH = 2  # KV blocks: narrower tables are padded (a dim of 1 would get its own graph)


def _layer_step(
    layer: nn.Module,
    x: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    tables: torch.Tensor,
    mask: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """One decoder layer over a decode-only batch; the batch metadata is rebuilt here from
    tensors, so its sizes are the graph's dynamic dims (an int argument would be guarded on)."""
    batch = AttentionBatch(slot_mapping, tables.shape[0], tables, mask, [], block_size)
    return layer(x, positions, batch, (k_cache, v_cache))


class CompiledDecode:
    """Decode-only steps through one compiled decoder layer that every layer calls with its own
    weights and KV (inductor's code takes them as inputs): two graphs in all, batch 1 and any
    larger batch, each over any KV width. Nothing is padded to buckets, so no step of up to
    `max_batch` sequences misses and nothing compiles mid-serving after the warm-up. Whole-model
    graphs took ~100 s of CPU each to compile for SmolLM2's 30 layers; one layer takes a few.
    Mixed steps (prefill chunks, a Python list of varying length) run eagerly. Call from the
    device thread."""

    def __init__(self, model: nn.Module, cache: PagedKVCache, max_batch: int) -> None:
        self.model, self.cache, self.max_batch = model, cache, max_batch
        self.block_size = cache.block_size
        self.max_width = -(-model.max_model_len // cache.block_size)
        self.layer: Callable[..., torch.Tensor] = torch.compile(
            _layer_step, dynamic=False, fullgraph=True
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor | None:
        """The hidden states [B, hidden] of a decode-only step; None when the step has prefill
        chunks or more sequences than the engine runs (run it eagerly)."""
        n = batch.num_decodes
        if batch.prefills or n == 0 or n != input_ids.shape[0] or n > self.max_batch:
            return None
        tables, mask = batch.decode_tables, batch.decode_mask
        if tables.shape[1] < MIN_WIDTH:  # padded blocks are masked out
            pad = MIN_WIDTH - tables.shape[1]
            # plain tensors, as the host's others are: graphs are guarded on the dispatch keys
            with torch.inference_mode(False):
                tables = F.pad(tables, (0, pad))
                mask = F.pad(mask, (0, pad * self.block_size))
        model, slots = self.model, batch.slot_mapping
        x = model.embed_tokens(input_ids)
        _mark_dynamic(n, x, positions, slots, tables, mask)
        for layer, (k, v) in zip(model.layers, self.cache.layers):
            x = self.layer(layer, x, positions, slots, tables, mask, k, v, self.block_size)
        return model.norm(x)

    def warm_up(self) -> None:
        """Compile both graphs (or load them from the on-disk caches) on idle inputs that
        write only the scratch slot; logs what was compiled and how long it took."""
        sizes = sorted({1, min(2, self.max_batch)})
        device = self.cache.layers[0][0].device
        long = dict(dtype=torch.long, device=device)
        for size in tqdm(sizes, desc="compiling the decode forward", unit="graph", leave=False):
            start = time.perf_counter()
            width = MIN_WIDTH * self.block_size
            mask = torch.zeros(size, 1, 1, width, dtype=torch.bool, device=device)
            mask[..., 0] = True
            slots = torch.full((size,), self.cache.scratch_slot, **long)
            tables = torch.zeros(size, MIN_WIDTH, **long)
            batch = AttentionBatch(slots, size, tables, mask, [], self.block_size)
            tokens, positions = torch.zeros(size, **long), torch.zeros(size, **long)
            with torch.inference_mode():  # as the runner's: its inputs made outside
                self.run(tokens, positions, batch)
            log.info(
                "decode_forward_compiled",
                batch="1" if size == 1 else f"2..{self.max_batch}",
                kv_blocks=f"{MIN_WIDTH}..{self.max_width}",
                seconds=round(time.perf_counter() - start, 2),
            )


def _mark_dynamic(n: int, x: torch.Tensor, *metadata: torch.Tensor) -> None:
    """Dynamic dims: the batch where above one, the KV width always."""
    positions, slots, tables, mask = metadata
    if n > 1:
        for t in (x, positions, slots, tables, mask):
            torch._dynamo.mark_dynamic(t, 0)
    torch._dynamo.mark_dynamic(tables, 1)
    torch._dynamo.mark_dynamic(mask, 3)

"""The CPU counterpart of the CUDA decode graphs: the dense decoder layer compiled by inductor
(C++/OpenMP) once for all layers, dynamic in batch and KV width, its artifacts cached on disk;
steps with prefill chunks through the layer's two halves around an eager attention."""

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

# narrower steps are padded: a dim of 1 would get a graph of its own
MIN_WIDTH = 2  # KV blocks
MIN_ROWS = 2  # sequences


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


def _attention_in(
    layer: nn.Module, x: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return layer.attention_in(x, positions)


def _attention_out(layer: nn.Module, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    return layer.attention_out(x, o)


class CompiledDecode:
    """Decode-only steps through one compiled decoder layer that every layer calls with its own
    weights and KV (inductor's code takes them as inputs): one graph, dynamic in batch and KV
    width. Nothing is padded to buckets, so no step of up to `max_batch` sequences misses and
    nothing compiles mid-serving after the warm-up. A lone sequence is padded to two rows (a
    dim of 1 would get a graph of its own; a bf16 GEMM of two rows is no slower than of one),
    the padded row writing its KV to the scratch slot. Whole-model graphs took ~100 s of CPU
    each to compile for SmolLM2's 30 layers; one layer takes a few.

    Steps with prefill chunks (a Python list of varying length, which a graph cannot take)
    run each layer as two compiled halves, dynamic in the token count, around the eager
    paged attention: norms, projections, RoPE and the MLP in two calls instead of ~50 torch
    ops a layer. A step of one token runs eagerly. Call from the device thread."""

    def __init__(self, model: nn.Module, cache: PagedKVCache, max_batch: int) -> None:
        self.model, self.cache, self.max_batch = model, cache, max_batch
        self.block_size = cache.block_size
        self.max_width = -(-model.max_model_len // cache.block_size)
        self.layer: Callable[..., torch.Tensor] = torch.compile(
            _layer_step, dynamic=False, fullgraph=True
        )
        self.attention_in: Callable[..., tuple[torch.Tensor, ...]] = torch.compile(
            _attention_in, dynamic=False, fullgraph=True
        )
        self.attention_out: Callable[..., torch.Tensor] = torch.compile(
            _attention_out, dynamic=False, fullgraph=True
        )
        self.failed = False  # the warm-up could not compile (no C++ compiler...): all eager

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor | None:
        """The hidden states of the step's tokens; None where it runs eagerly: more sequences
        than the engine runs, one token, or the warm-up could not compile."""
        n = batch.num_decodes
        if self.failed:
            return None
        if batch.prefills:
            return self._run_mixed(input_ids, positions, batch)
        if n == 0 or n != input_ids.shape[0] or n > self.max_batch:
            return None
        slots, tables, mask = batch.slot_mapping, batch.decode_tables, batch.decode_mask
        # plain tensors, as the host's others are: graphs are guarded on the dispatch keys
        with torch.inference_mode(False):
            if tables.shape[1] < MIN_WIDTH:  # padded blocks are masked out
                pad = MIN_WIDTH - tables.shape[1]
                tables = F.pad(tables, (0, pad))
                mask = F.pad(mask, (0, pad * self.block_size))
            if n < MIN_ROWS:  # the padded row attends block 0's first slot, only read
                pad = MIN_ROWS - n
                input_ids, positions = F.pad(input_ids, (0, pad)), F.pad(positions, (0, pad))
                slots = F.pad(slots, (0, pad), value=self.cache.scratch_slot)
                tables = F.pad(tables, (0, 0, 0, pad))
                idle = torch.zeros_like(mask[:1]).expand(pad, -1, -1, -1).clone()
                idle[..., 0] = True
                mask = torch.cat([mask, idle])
        model = self.model
        x = model.embed_tokens(input_ids)
        for t in (x, positions, slots, tables, mask):
            torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(tables, 1)
        torch._dynamo.mark_dynamic(mask, 3)
        for layer, (k, v) in zip(model.layers, self.cache.layers):
            x = self.layer(layer, x, positions, slots, tables, mask, k, v, self.block_size)
        return model.norm(x[:n])

    def _run_mixed(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor | None:
        """The hidden states [T, hidden] of a step with prefill chunks; None for one token."""
        if input_ids.shape[0] < MIN_ROWS:
            return None
        model = self.model
        x = model.embed_tokens(input_ids)
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(positions, 0)
        for layer, kv in zip(model.layers, self.cache.layers):
            q, k, v = self.attention_in(layer, x, positions)
            o = layer.self_attn.attend(q, k, v, batch, kv)
            torch._dynamo.mark_dynamic(o, 0)
            x = self.attention_out(layer, x, o)
        return model.norm(x)

    def _warm_up_mixed(self) -> None:
        """The two halves' graphs, on two tokens that touch no cache."""
        device = self.cache.layers[0][0].device
        positions = torch.zeros(MIN_ROWS, dtype=torch.long, device=device)  # plain, as the host's
        with torch.inference_mode():
            layer = self.model.layers[0]
            x = self.model.embed_tokens(torch.zeros(MIN_ROWS, dtype=torch.long, device=device))
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(positions, 0)
            q, _, _ = self.attention_in(layer, x, positions)
            o = q.reshape(MIN_ROWS, -1).clone()
            torch._dynamo.mark_dynamic(o, 0)
            self.attention_out(layer, x, o)

    def warm_up(self) -> None:
        """Compile the graph (or load it from the on-disk caches) on an idle batch that writes
        only the scratch slot; logs how long that took."""
        device = self.cache.layers[0][0].device
        long = dict(dtype=torch.long, device=device)
        start = time.perf_counter()
        mask = torch.zeros(1, 1, 1, MIN_WIDTH * self.block_size, dtype=torch.bool, device=device)
        mask[..., 0] = True
        slots = torch.full((1,), self.cache.scratch_slot, **long)
        tables = torch.zeros(1, MIN_WIDTH, **long)
        batch = AttentionBatch(slots, 1, tables, mask, [], self.block_size)
        tokens, positions = torch.zeros(1, **long), torch.zeros(1, **long)
        with tqdm(total=2, desc="compiling the forward", unit="graph", leave=False) as bar:
            try:
                with torch.inference_mode():  # as the runner's: its inputs made outside
                    self.run(tokens, positions, batch)
                bar.update()
                self._warm_up_mixed()
            except Exception as e:  # inductor's errors have no common base; serve eagerly
                self.failed = True
                log.warning("decode_forward_not_compiled", error=f"{type(e).__name__}: {e}"[:500])
                return
            bar.update()
        log.info(
            "decode_forward_compiled",
            batch=f"1..{self.max_batch}",
            kv_blocks=f"1..{self.max_width}",
            seconds=round(time.perf_counter() - start, 2),
        )

"""The CPU counterpart of the CUDA decode graphs: decode steps through one C++ op over all
layers where it serves the model (`fused_decode`), else through the dense decoder layer
compiled by inductor (C++/OpenMP) once for all layers, dynamic in batch and KV width, saved
whole on disk; steps with prefill chunks through the layer's two halves around an eager
attention."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from daemon.models.attention import AttentionBatch, PagedKVCache
from daemon.models.compiled_artifacts import CompiledArtifacts, artifact_key, artifacts_root
from daemon.models.fused_decode import FusedDecode
from kernels import cpu_build, paged_attention_cpu

if TYPE_CHECKING:
    from torch._dynamo.aot_compile import AOTCompiledFunction

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


@dataclass
class _Graphs:
    """The compiled functions; each step checks the guards of its first layer's call only (the
    other layers' inputs have its shapes), the rest run unchecked. No decode layer where the
    fused op runs decode steps."""

    layer: AOTCompiledFunction | None
    attention_in: AOTCompiledFunction
    attention_out: AOTCompiledFunction


class CompiledDecode:
    """Decode-only steps through one compiled decoder layer that every layer calls with its own
    weights and KV (inductor's code takes them as inputs): one graph, dynamic in batch and KV
    width. Nothing is padded to buckets, so no step of up to `max_batch` sequences misses and
    nothing compiles mid-serving after the warm-up. A lone sequence is padded to two rows (a
    dim of 1 would get a graph of its own; a bf16 GEMM of two rows is no slower than of one),
    the padded row writing its KV to the scratch slot. Whole-model graphs took ~100 s of CPU
    each to compile for SmolLM2's 30 layers; one layer takes a few. Where `fused` is given
    (`FusedDecode.of`: a Llama-style model the C++ op serves), decode-only steps run through
    it instead, all layers in one call, and the decode layer is not compiled: SmolLM2-135M's
    30 layers at 1 / 16 / 64 sequences in bf16 1.3-1.4x / 1.1-1.15x / 1.07-1.11x faster than
    the compiled layer's 30 calls, in fp32 1.29x / 1.19x / 1.12x (`bench.cpu_kernels layers`).

    Steps with prefill chunks (a Python list of varying length, which a graph cannot take)
    run each layer as two compiled halves, dynamic in the token count, around the eager
    paged attention: norms, projections, RoPE and the MLP in two calls instead of ~50 torch
    ops a layer. A step of one token runs eagerly.

    The graphs are compiled ahead by dynamo (`aot_compile`) and saved whole beside inductor's
    caches (`compiled_artifacts`), so a restart loads them without tracing or compiling; a
    saved graph that does not load or run is compiled again. A step whose inputs fail a
    graph's guards runs eagerly (nothing compiles mid-serving). Call from the device thread."""

    def __init__(
        self,
        model: nn.Module,
        cache: PagedKVCache,
        max_batch: int,
        fused: FusedDecode | None = None,
    ) -> None:
        self.model, self.cache, self.max_batch, self.fused = model, cache, max_batch, fused
        self.block_size = cache.block_size
        self.max_width = -(-model.max_model_len // cache.block_size)
        self.graphs: _Graphs | None = None  # made by warm_up
        self.failed = False  # the warm-up could not compile (no C++ compiler...): all eager
        self.loaded = 0  # graphs the warm-up loaded from disk
        self.compiled = 0  # and those it compiled
        self.misses = 0  # steps run eagerly because their inputs failed a graph's guards
        self.artifacts: Path | None = None  # where the warm-up looked for saved graphs

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor | None:
        """The hidden states of the step's tokens; None where it runs eagerly: more sequences
        than the engine runs, one token, or no graphs (not warmed up, or could not compile)."""
        graphs, n = self.graphs, batch.num_decodes
        if graphs is None:
            return None
        if batch.prefills:
            return self._run_mixed(graphs, input_ids, positions, batch)
        if n == 0 or n != input_ids.shape[0] or n > self.max_batch:
            return None
        if self.fused is not None:
            x = self.fused.run(self.model.embed_tokens(input_ids), positions, batch)
            return self.model.norm(x)
        assert graphs.layer is not None  # compiled wherever nothing fused runs decodes
        x, positions, slots, tables, mask = self._decode_inputs(input_ids, positions, batch)
        layers, kv = self.model.layers, self.cache.layers
        first = (layers[0], x, positions, slots, tables, mask, *kv[0], self.block_size)
        if not self._admits(graphs.layer, first):
            return None
        for layer, (k, v) in zip(layers, kv):
            x = graphs.layer(layer, x, positions, slots, tables, mask, k, v, self.block_size)
        return self.model.norm(x[:n])

    def _decode_inputs(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch
    ) -> tuple[torch.Tensor, ...]:
        """(hidden, positions, slots, tables, mask) of a decode-only step, padded to at least
        MIN_ROWS rows and MIN_WIDTH blocks."""
        n = batch.num_decodes
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
        return self.model.embed_tokens(input_ids), positions, slots, tables, mask

    def _run_mixed(
        self,
        graphs: _Graphs,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
    ) -> torch.Tensor | None:
        """The hidden states [T, hidden] of a step with prefill chunks; None for one token."""
        if input_ids.shape[0] < MIN_ROWS:
            return None
        model = self.model
        x = model.embed_tokens(input_ids)
        if not self._admits(graphs.attention_in, (model.layers[0], x, positions)):
            return None
        for i, (layer, kv) in enumerate(zip(model.layers, self.cache.layers)):
            q, k, v = graphs.attention_in(layer, x, positions)
            o = layer.self_attn.attend(q, k, v, batch, kv)
            # an eager rerun writes layer 0's KV again, the same values to the same slots
            if i == 0 and not self._admits(graphs.attention_out, (layer, x, o)):
                return None
            x = graphs.attention_out(layer, x, o)
        return model.norm(x)

    def _admits(self, graph: AOTCompiledFunction, args: tuple[object, ...]) -> bool:
        if graph.guard_check(*args):
            return True
        self.misses += 1
        if self.misses == 1:  # then counted only: a shape of some step the tests did not make
            log.warning("compiled_forward_guard_miss", shapes=[_shape(a) for a in args])
        return False

    def warm_up(self) -> None:
        """Load the graphs saved by an earlier start, or compile (and save) them, then run
        them once on an idle batch that writes only the scratch slot; logs how long it took
        and how many were loaded."""
        start = time.perf_counter()
        k = self.cache.layers[0][0]
        store = CompiledArtifacts(
            artifacts_root(),
            artifact_key(
                self.model.layers[0],
                {
                    "kv": [list(k.shape), str(k.dtype)],
                    "block_size": self.block_size,
                    "paged_kernel": paged_attention_cpu.ENABLED and cpu_build.available(),
                },
            ),
        )
        self.artifacts = store.dir
        for reuse in (True, False):
            try:
                self._make(store, reuse)
                break
            except Exception as e:  # inductor's errors have no common base
                self.graphs, error = None, f"{type(e).__name__}: {e}"[:500]
                if reuse and self.loaded:  # the saved ones may be why: compile them all again
                    log.warning("compiled_artifacts_failed", path=str(store.dir), error=error)
                    store.drop()
                    continue
                self.failed = True  # serve eagerly
                store.drop()
                log.warning("decode_forward_not_compiled", error=error)
                return
        log.info(
            "decode_forward_compiled",
            batch=f"1..{self.max_batch}",
            kv_blocks=f"1..{self.max_width}",
            fused=self.fused is not None,
            loaded=self.loaded,
            compiled=self.compiled,
            seconds=round(time.perf_counter() - start, 2),
        )

    def _make(self, store: CompiledArtifacts, reuse: bool) -> None:
        """The graphs (loaded where `reuse` and saved, else compiled), each run once; the
        decode layer only where nothing fused runs decode steps. Compiled on inputs whose
        dynamic dims are marked; checked and run on unmarked ones, as serving's (a loaded graph
        refuses marked inputs)."""
        self.loaded = self.compiled = self.misses = 0
        layer, (k, v) = self.model.layers[0], self.cache.layers[0]
        embed = self.model.embed_tokens

        def get(name: str, fn: Callable[..., object], example: Callable[[bool], tuple]):
            graph = store.load(name) if reuse else None
            if graph is None:
                graph = store.compile(name, fn, example(True))
                self.compiled += 1
            else:
                self.loaded += 1
            graph.disable_guard_check()  # each step checks its first call's (_admits)
            args = example(False)
            if not graph.guard_check(*args):
                raise RuntimeError(f"the compiled graph {name} refuses the warm-up's inputs")
            bar.update()
            return graph, args

        def decode(marked: bool) -> tuple:
            x, *rest = self._decode_inputs(*self._idle_decode())
            if marked:
                for t in (x, *rest):
                    torch._dynamo.mark_dynamic(t, 0)
                torch._dynamo.mark_dynamic(rest[2], 1)  # tables' width
                torch._dynamo.mark_dynamic(rest[3], 3)  # the mask's
            return (layer, x, *rest, k, v, self.block_size)

        def halves_in(marked: bool) -> tuple:
            with torch.inference_mode(False):
                positions = torch.zeros(MIN_ROWS, dtype=torch.long, device=k.device)
            x = embed(torch.zeros_like(positions))
            if marked:
                torch._dynamo.mark_dynamic(x, 0)
                torch._dynamo.mark_dynamic(positions, 0)
            return (layer, x, positions)

        def halves_out(marked: bool) -> tuple:
            _, x, positions = halves_in(False)
            q, _, _ = attention_in(layer, x, positions)
            o = q.reshape(MIN_ROWS, -1).clone()
            if marked:
                torch._dynamo.mark_dynamic(x, 0)
                torch._dynamo.mark_dynamic(o, 0)
            return (layer, x, o)

        total = 2 if self.fused is not None else 3
        with (
            tqdm(total=total, desc="compiling the forward", unit="graph", leave=False) as bar,
            torch.inference_mode(),  # as the runner's steps: their inputs made outside
        ):
            layer_step = None
            if self.fused is None:
                layer_step, _ = get("decode_layer", _layer_step, decode)
            attention_in, _ = get("attention_in", _attention_in, halves_in)
            attention_out, args = get("attention_out", _attention_out, halves_out)
            attention_out(*args)
            self.graphs = _Graphs(layer_step, attention_in, attention_out)
            if self.run(*self._idle_decode()) is None:  # the idle batch through all layers
                raise RuntimeError("the decode forward refuses the idle batch")

    def _idle_decode(self) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """(tokens, positions, batch) of one idle decode that writes only the scratch slot,
        made outside inference mode, as the host's."""
        device = self.cache.layers[0][0].device
        long = dict(dtype=torch.long, device=device)
        with torch.inference_mode(False):
            mask = torch.zeros(
                1, 1, 1, MIN_WIDTH * self.block_size, dtype=torch.bool, device=device
            )
            mask[..., 0] = True
            slots = torch.full((1,), self.cache.scratch_slot, **long)
            tables = torch.zeros(1, MIN_WIDTH, **long)
            batch = AttentionBatch(slots, 1, tables, mask, [], self.block_size)
            return torch.zeros(1, **long), torch.zeros(1, **long), batch


def _shape(a: object) -> object:
    return list(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__

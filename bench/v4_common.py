"""Helpers shared by the DeepSeek-V4 benchmarks: a cProfile of the engine's device thread with a
per-step breakdown of where its time goes (attention, indexer, compressors, MoE, ...), and the
model's FLOPs per token and per run."""

from __future__ import annotations

import cProfile
import pstats
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from daemon.models.deepseek_v4.config import CSA, HCA, V4Config

# (label, file fragment, function names): cumulative time of these functions, as found; names
# that do not exist (yet, or any more) in the engine are skipped
PARTS: list[tuple[str, str, tuple[str, ...]]] = [
    ("model forward", "deepseek_v4/model.py", ("forward",)),
    ("  attention (whole layer)", "deepseek_v4/attention.py", ("V4Attention.forward",)),
    ("    chunks (all at once)", "deepseek_v4/attention.py", ("_attend_chunks",)),
    ("    batched decodes", "deepseek_v4/attention.py", ("_attend_decodes",)),
    (
        "    input projections (one matmul)",
        "deepseek_v4/sparse.py",
        ("SharedInputLinears.__call__",),
    ),
    (
        "    softmax attention",
        "deepseek_v4/sparse.py",
        (
            "part_logits",
            "part_values",
            "sink_softmax_",
            "WindowTiles.logits",
            "WindowTiles.values",
            "ChunkEntries.attend",
        ),
    ),
    ("    indexer top-k", "deepseek_v4/attention.py", ("select",)),
    ("    compressor updates", "deepseek_v4/compressor.py", ("update_chunks", "update_decode")),
    ("    row gathers", "deepseek_v4/sparse.py", ("gather_rows",)),
    ("  MoE (routed + shared)", "deepseek_v4/blocks.py", ("MoE.forward",)),
    ("  hyper-connections", "deepseek_v4/blocks.py", ("HyperConnection.forward",)),
    ("  RoPE", "deepseek_v4/blocks.py", ("apply",)),
    ("lm_head (compute_logits)", "deepseek_v4/model.py", ("compute_logits",)),
    ("sampling", "loop/sampler.py", ("sample",)),
    ("torch linear (all matmul weights)", "~", ("<built-in method torch._C._nn.linear>",)),
    ("torch einsum", "~", ("<built-in method torch.einsum>",)),
]


def _first_lines(stats: pstats.Stats) -> dict[tuple[str, int, str], tuple[float, float]]:
    return {k: (v[2], v[3]) for k, v in stats.stats.items()}  # type: ignore[attr-defined]


def _qualname(file: str, line: int) -> str:
    """`Class.method` for a def at `file:line` (reads the source; '' when it cannot)."""
    try:
        with open(file) as f:
            lines = f.readlines()
    except OSError:
        return ""
    name = lines[line - 1].split("def ", 1)[-1].split("(", 1)[0].strip()
    for text in reversed(lines[: line - 1]):
        if text.startswith("class "):
            return text[6:].split("(", 1)[0].split(":", 1)[0].strip() + "." + name
        if text.startswith("def "):
            return name
    return name


def breakdown(stats: pstats.Stats) -> list[tuple[str, float]]:
    """(label, cumulative seconds) for each entry of PARTS found in the profile."""
    found = _first_lines(stats)
    out: list[tuple[str, float]] = []
    for label, fragment, names in PARTS:
        total, hit = 0.0, False
        for (file, line, func), (_, cum) in found.items():
            if fragment not in file:
                continue
            qual = _qualname(file, line) if fragment != "~" else func
            if func in names or qual in names:
                # model.py's forward: only the causal LM's, not the decoder layer's
                if label == "model forward" and qual != "DeepseekV4ForCausalLM.forward":
                    continue
                total += cum
                hit = True
        if hit:
            out.append((label, total))
    return out


@dataclass
class DeviceProfile:
    """cProfile of `engine.runner.execute` for the steps `want(prepared_step)` picks."""

    engine: Any
    want: Callable[[Any], bool]
    profile: cProfile.Profile = field(default_factory=cProfile.Profile)
    step_seconds: list[float] = field(default_factory=list)
    _execute: Any = None

    def __enter__(self) -> DeviceProfile:
        self._execute = self.engine.runner.execute

        def execute(step: Any) -> Any:
            if not self.want(step):
                return self._execute(step)
            t0 = time.perf_counter()
            result = self.profile.runcall(self._execute, step)
            self.step_seconds.append(time.perf_counter() - t0)
            return result

        self.engine.runner.execute = execute
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.runner.execute = self._execute

    def report(self, title: str, top: int = 0) -> str:
        n = len(self.step_seconds)
        if n == 0:
            return f"{title}: no steps profiled"
        stats = pstats.Stats(self.profile)
        total = sum(self.step_seconds)
        lines = [f"{title}: {n} steps, {1e3 * total / n:.1f} ms per step under cProfile"]
        for label, seconds in breakdown(stats):
            lines.append(f"  {label:<36} {1e3 * seconds / n:>8.1f} ms  {seconds / total:>5.0%}")
        if top:
            import io

            stream = io.StringIO()
            pstats.Stats(self.profile, stream=stream).sort_stats("tottime").print_stats(top)
            lines.append(stream.getvalue())
        return "\n".join(lines)


def engine_threads(args: Any) -> dict[str, int]:
    """EngineConfig keyword for --engine-threads, only when given."""
    return {"cpu_threads": args.engine_threads} if args.engine_threads else {}


def forward_threads(engine: Any) -> int:
    """Torch threads the engine's forward runs with on a CPU device."""
    return getattr(engine.runner, "cpu_threads", 0) or torch.get_num_threads()


def is_decode_step(step: Any) -> bool:
    """Every sequence of the prepared step computes exactly one token."""
    return step.input_ids.numel() == len(step.attention.seqs)


def work_per_token(cfg: V4Config, context: int) -> tuple[float, float]:
    """FLOPs of one token at `context` tokens of context: (the model without lm_head and
    without the indexer's scoring, the indexer scoring every closed CSA entry). Counts the
    matmuls: projections, the routed experts and the shared one, hyper-connection mixes,
    attention over the window (or the context, while shorter), the top-k CSA entries and every
    HCA entry."""
    h, hd, heads, ql = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.q_lora_rank
    ih, ihd = cfg.index_n_heads, cfg.index_head_dim
    layer = h * ql + ql * heads * hd + h * hd + heads * hd * cfg.o_lora_rank
    layer += cfg.o_groups * cfg.o_lora_rank * h + min(context, cfg.sliding_window) * heads * hd * 2
    layer += (cfg.num_experts_per_tok + 1) * 3 * h * cfg.moe_intermediate_size
    layer += h * cfg.num_experts + 2 * cfg.hc_mult * h * (2 + cfg.hc_mult) * cfg.hc_mult
    model = index = 0
    for kind in cfg.layer_types:
        model += layer
        if kind == CSA:
            entries = context // cfg.csa_rate
            model += 4 * h * hd + ql * ih * ihd + h * ih + 4 * h * ihd  # compressors, indexer q
            model += min(cfg.index_topk, entries) * heads * hd * 2
            index += entries * ih * (ihd + 1)
        elif kind == HCA:
            model += 2 * h * hd + context // cfg.hca_rate * heads * hd * 2
    return 2.0 * model, 2.0 * index


def run_flops(cfg: V4Config, requests: int, prompt: int, output: int) -> float:
    """FLOPs of `requests` greedy requests: the prompt's prefill with lm_head on its last row,
    then `output - 1` decode tokens with lm_head each (as `work_per_token` counts them)."""
    lm_head = 2.0 * cfg.hidden_size * cfg.vocab_size
    prefill = sum(sum(work_per_token(cfg, c)) for c in range(1, prompt + 1)) + lm_head
    decode = sum(sum(work_per_token(cfg, c)) + lm_head for c in range(prompt + 1, prompt + output))
    return requests * (prefill + decode)

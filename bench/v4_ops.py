"""Torch ops per DeepSeek-V4 step: what an accelerator launches one by one in an eager step, and
what a decode graph holds. Counts, not times, so they hold on any machine.

    python -m bench.v4_ops [--concurrency 32 --prompt-len 256 --graph-positions 512]

Eager steps: the engine on the CPU runs the bench model's workload (all prompts at once, then
decodes) with every op its forward dispatches counted, by part of the model. Graph: the padded
decode step of `--concurrency` rows, run on the "meta" device (shapes only) the way a CUDA graph
captures it; on CUDA the Triton kernels replace the mHC Sinkhorn and the expert loop there.
View and allocation ops are counted apart: they launch nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.common import quiet_logs
from bench.v4_common import is_decode_step
from bench.v4_throughput import V4_BENCH, make_bench_checkpoint, prompts, run_ours

NO_LAUNCH = {
    "alias", "as_strided", "chunk", "detach", "empty", "empty_like", "empty_strided", "expand",
    "flatten", "new_empty", "numpy_T", "permute", "select", "slice", "split",
    "split_with_sizes", "squeeze", "t", "transpose", "unbind", "unflatten", "unfold",
    "unsqueeze", "view", "view_as_complex", "view_as_real", "_reshape_alias", "_unsafe_view",
}  # fmt: skip

# (label, class, method): ops dispatched while the method runs count to the innermost label
PARTS = [
    ("attention: chunks", "daemon.models.deepseek_v4.attention", "V4Attention", "_attend_chunks"),
    ("attention: decodes", "daemon.models.deepseek_v4.attention", "V4Attention", "_attend_decodes"),
    ("attention: rest", "daemon.models.deepseek_v4.attention", "V4Attention", "forward"),
    ("compressors", "daemon.models.deepseek_v4.compressor", "Compressor", "update_chunks"),
    ("compressors", "daemon.models.deepseek_v4.compressor", "Compressor", "update_decode"),
    ("MoE", "daemon.models.deepseek_v4.blocks", "MoE", "forward"),
    ("mHC", "daemon.models.deepseek_v4.blocks", "HyperConnection", "forward"),
    ("mHC", "daemon.models.deepseek_v4.blocks", "HyperConnection", "expand"),
    ("lm_head", "daemon.models.deepseek_v4.model", "DeepseekV4ForCausalLM", "compute_logits"),
]


class OpCount(TorchDispatchMode):
    """Ops dispatched, by the innermost PARTS label running ("other" outside them)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.no_launch = 0
        self.labels: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func._schema.name.split("::")[-1] in NO_LAUNCH:
            self.no_launch += 1
        else:
            self.ops[self.labels[-1] if self.labels else "other"] += 1
        return func(*args, **(kwargs or {}))


COUNTING: list[OpCount] = []


def _label_parts() -> None:
    import importlib

    for label, module, cls_name, method in PARTS:
        cls = getattr(importlib.import_module(module), cls_name)
        inner = getattr(cls, method, None)
        if inner is None:  # not in this version of the model
            continue

        @functools.wraps(inner)
        def wrapper(*args: Any, _inner: Any = inner, _label: str = label, **kw: Any) -> Any:
            if not COUNTING:
                return _inner(*args, **kw)
            COUNTING[-1].labels.append(_label)
            try:
                return _inner(*args, **kw)
            finally:
                COUNTING[-1].labels.pop()

        setattr(cls, method, wrapper)


def report(title: str, counts: list[OpCount]) -> None:
    n = len(counts)
    total = sum(sum(c.ops.values()) for c in counts) / n
    views = sum(c.no_launch for c in counts) / n
    print(f"{title}: {n} steps, {total:,.0f} ops per step (+ {views:,.0f} views / allocations)")
    parts: Counter[str] = Counter()
    for c in counts:
        parts.update(c.ops)
    for label, ops in parts.most_common():
        print(f"  {label:<22} {ops / n:>8,.0f}")


async def eager_steps(args: argparse.Namespace) -> None:
    from daemon.build.config import EngineConfig
    from daemon.build.engine import build_engine

    path = make_bench_checkpoint(Path(tempfile.mkdtemp(prefix="deepinfer-v4-ops-")))
    engine, _ = build_engine(
        EngineConfig(
            model=str(path),
            kv_cache_memory_gb=1.0,
            max_num_seqs=args.concurrency,
            max_num_batched_tokens=2048,
        )
    )
    execute = engine.runner.execute
    prefill: list[OpCount] = []
    decode: list[OpCount] = []

    def counted(step: Any, *rest: Any) -> Any:
        count = OpCount()
        COUNTING.append(count)
        try:
            with count:
                return execute(step, *rest)
        finally:
            COUNTING.pop()
            (decode if is_decode_step(step) else prefill).append(count)

    await engine.start()
    try:
        engine.runner.execute = counted
        batch = prompts(args.concurrency, args.prompt_len, V4_BENCH["vocab_size"], 0)
        await run_ours(engine, batch, args.output_len)
    finally:
        engine.runner.execute = execute
        await engine.stop()
    report(f"eager prefill steps ({args.concurrency} x {args.prompt_len} tokens)", prefill)
    report(f"eager decode steps ({args.concurrency} requests)", decode)


def graph_step(args: argparse.Namespace) -> None:
    from transformers import DeepseekV4Config

    from daemon.models.deepseek_v4.batch import DecodeShape
    from daemon.models.deepseek_v4.cache import V4Cache
    from daemon.models.deepseek_v4.config import V4Config
    from daemon.models.deepseek_v4.graphs import V4StaticInputs
    from daemon.models.deepseek_v4.model import DeepseekV4ForCausalLM

    hf = DeepseekV4Config(**{k: v for k, v in V4_BENCH.items() if v is not None})
    cfg = V4Config.from_hf(hf.to_dict())
    meta = torch.device("meta")
    with meta:
        model = DeepseekV4ForCausalLM(cfg, meta)
    groups = model.kv_groups(torch.float32, 0)
    cache = V4Cache(cfg, groups, [2 * args.concurrency] * len(groups), meta)
    shape = DecodeShape(args.concurrency, args.graph_positions)
    inputs = V4StaticInputs.allocate(shape, cache, meta)
    count = OpCount()
    COUNTING.append(count)
    with torch.inference_mode(), count:
        model(inputs.input_ids, inputs.positions, inputs.attention(), cache)
    COUNTING.pop()
    report(f"decode graph {shape} (meta device, Triton kernels as one op each)", [count])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--graph-positions", type=int, default=512)
    args = p.parse_args()
    quiet_logs()
    _label_parts()
    asyncio.run(eager_steps(args))
    graph_step(args)


if __name__ == "__main__":
    main()

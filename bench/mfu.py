"""Model FLOPs utilization of our decode step: FLOP/s the engine achieves at batch B on the
throughput model (or a checkpoint: --model) vs this machine's measured matmul peak in the run's
dtype; --profile adds the time of a full-batch decode step by op class.

    python -m bench.mfu [--batch 64 --prompt-len 128 --output-len 64 --size 2048]
    python -m bench.mfu --model /tmp/smollm2-hf --dtype bfloat16 --batch 1 16 64 --profile

Per generated token: 2 * (qkv + o + gate/up/down per layer + lm_head weights) FLOPs for the
matmuls plus 4 * ctx * heads * head_dim per layer for QK^T and PV.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    ModelSpec,
    Request,
    build_ours,
    machine,
    make_checkpoint,
    make_workload,
    median,
    median_us,
    profile_steps,
    quiet_logs,
    replay_ms,
    run_ours,
)
from bench.step_profile import StepOpProfile, decode_at, report, write_json
from kernels import packed_linear

RESULTS = Path(__file__).parent / "results" / "step-profiles"


def matmul_gflops(m: int, k: int, n: int, reps: int, dtype: torch.dtype = torch.float32) -> float:
    """Median GFLOP/s of a [m, k] x [k, n] matmul (weights stored [n, k] as nn.Linear): the
    better of the plain product and, where the engine packs such weights, the packed one
    (`kernels.packed_linear`), so that the peak is the best this machine does."""
    a, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    out = torch.empty(m, n, dtype=dtype)
    runs = {"plain": lambda: torch.mm(a, w.t(), out=out)}
    if packed_linear.pack(w):
        runs["packed"] = lambda: packed_linear.linear(a, w, None)
    with torch.inference_mode():  # each timed alone: alternating calls evict each other's weight
        best_us = min(median_us({name: fn}, reps)[name] for name, fn in runs.items())
    return 2 * m * k * n / best_us / 1e3


def decode_shapes(spec: ModelSpec, batch: int) -> list[tuple[str, int, int, int, int]]:
    """(name, m, k, n, count per step) of the decode step's matmuls."""
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    layers = spec.num_layers
    return [
        ("qkv_proj", batch, spec.hidden, q + 2 * kv, layers),
        ("o_proj", batch, q, spec.hidden, layers),
        ("gate_up_proj", batch, spec.hidden, 2 * spec.intermediate, layers),
        ("down_proj", batch, spec.intermediate, spec.hidden, layers),
        ("lm_head", batch, spec.hidden, spec.vocab, 1),
    ]


async def engine_decode(
    spec: ModelSpec, path: Path, args: argparse.Namespace
) -> dict[int, tuple[float, float, float, float]]:
    """For each batch B: run B requests with equal prompts and outputs; over the window in which
    all of them are decoding, (achieved model FLOP/s, decode tok/s, median forward+sample ms
    per full-batch step inside the engine, the same step replayed alone)."""
    top = max(args.batch)
    engine = build_ours(
        path,
        not args.no_overlap,
        args.kv_cache_gb,
        top,
        args.max_num_batched_tokens,
        dtype=args.dtype,
    )
    await engine.start()
    await run_ours(engine, make_workload(4, (16, 32), (4, 4), spec.vocab, args.seed + 1))
    prof = profile_steps(engine)
    windows: dict[int, tuple[float, float, float]] = {}
    for batch in args.batch:
        workload = [
            Request(r.prompt, args.output_len)
            for r in make_workload(
                batch, (args.prompt_len, args.prompt_len), (1, 1), spec.vocab, args.seed + batch
            )
        ]
        run = await run_ours(engine, workload, desc=f"decode at batch {batch}")
        start = max(t.token_times[0] for t in run.timings)  # the last request has joined
        end = min(t.token_times[-1] for t in run.timings)  # the first request is done
        flops, tokens = 0.0, 0
        for t in run.timings:
            for i, stamp in enumerate(t.token_times):
                if start < stamp <= end:
                    # token i is sampled from a forward over position prompt_len + i - 1
                    flops += spec.token_flops(args.prompt_len + i)
                    tokens += 1
        full = [i for i, (b, d) in enumerate(zip(prof.batch, prof.decode_only)) if d and b == batch]
        step_ms = 1e3 * median([prof.execute[i] for i in full])
        windows[batch] = (flops / (end - start), tokens / (end - start), step_ms)
        if args.profile:  # a shorter run of its own: the profiler slows the steps it watches
            ops = StepOpProfile(engine, decode_at(batch), steps=args.profile_steps)
            length = ops.skip + ops.steps + 3
            with ops:
                await run_ours(
                    engine, [Request(r.prompt, length) for r in workload], f"profile at {batch}"
                )
            title = f"decode step at batch {batch} ({args.dtype})"
            summary = ops.summary()
            print(report(title, summary))
            name = f"mfu-{args.profile_name or path.name}-{args.dtype}-b{batch}.json"
            context = _context(spec, path, args) | {"step_ms_timed_run": step_ms}
            write_json(args.profile_dir / name, title, summary, **context)
    await engine.stop()
    return {b: (*windows[b], replay_ms(engine, prof.decode_steps[b])) for b in args.batch}


def _context(spec: ModelSpec, path: Path, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "bench": "mfu",
        "model": spec.describe(args.dtype),
        "checkpoint": str(path),
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "overlap": not args.no_overlap,
        "machine": machine(),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", type=int, default=2048, help="square matmul size for the peak")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--batch", type=int, nargs="+", default=[64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", type=Path, help="a Llama-style HF checkpoint instead of random")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--no-overlap", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = default)")
    p.add_argument(
        "--profile", action="store_true", help="time by op class of full-batch decode steps"
    )
    p.add_argument("--profile-steps", type=int, default=10, help="steps in the profile window")
    p.add_argument("--profile-dir", type=Path, default=RESULTS, help="where the JSON goes")
    p.add_argument("--profile-name", default="", help="the JSON's model name (default: dir)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet_logs()
    if args.model:
        spec, path = ModelSpec.from_config(args.model), args.model
    else:
        spec = ModelSpec(
            args.layers, args.hidden, args.heads, args.kv_heads, args.intermediate, args.vocab
        )
        path = make_checkpoint(spec, seed=args.seed)
    print(f"model: {spec.describe(args.dtype)} [{path}]; {machine()}")

    n = args.size
    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    name = str(dtype).removeprefix("torch.")
    peak = matmul_gflops(n, n, n, args.reps, dtype)
    print(f"{name} matmul {n}x{n}x{n}: {peak:.1f} GFLOP/s (median of {args.reps})")
    shaped: dict[int, float] = {}
    for batch in args.batch:
        total_flops = total_time = 0.0
        for label, m, k, nn, count in decode_shapes(spec, batch):
            g = matmul_gflops(m, k, nn, args.reps, dtype)
            flops = 2 * m * k * nn * count
            total_flops += flops
            total_time += flops / (g * 1e9)
            print(f"  decode shape {label:13s} [{m}, {k}] x [{k}, {nn}] x{count}: {g:6.1f} GFLOP/s")
        shaped[batch] = total_flops / total_time / 1e9
        print(
            f"  batch {batch} decode-step matmuls together: {shaped[batch]:.1f} GFLOP/s "
            f"({1e3 * total_time:.1f} ms per step of pure matmul)"
        )

    runs = asyncio.run(engine_decode(spec, path, args))
    overlap = "off" if args.no_overlap else "on"
    for batch, (achieved, tok_s, step_ms, alone_ms) in runs.items():
        step_flops = batch * spec.token_flops(args.prompt_len + args.output_len)
        print(
            f"engine decode at batch {batch} (prompt {args.prompt_len}, output "
            f"{args.output_len}, overlap {overlap}, {args.dtype}): {tok_s:.1f} tok/s, "
            f"{achieved / 1e9:.1f} GFLOP/s achieved"
        )
        print(
            f"  forward+sample of a full-batch step: {step_ms:.1f} ms inside the engine, "
            f"{alone_ms:.1f} ms replayed alone "
            f"(= {step_flops / (alone_ms / 1e3) / 1e9:.1f} GFLOP/s)"
        )
        print(f"  MFU vs {n}^3 matmul peak:          {100 * achieved / (peak * 1e9):5.1f} %")
        print(
            f"  MFU vs decode-shaped matmul rate: {100 * achieved / (shaped[batch] * 1e9):5.1f} %"
        )


if __name__ == "__main__":
    main()

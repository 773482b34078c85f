"""Model FLOPs utilization of our decode step: FLOP/s the engine achieves at batch B on the
throughput model vs this machine's measured fp32 matmul peak.

    python -m bench.mfu [--batch 64 --prompt-len 128 --output-len 64 --size 2048]

Per generated token: 2 * (qkv + o + gate/up/down per layer + lm_head weights) FLOPs for the
matmuls plus 4 * ctx * heads * head_dim per layer for QK^T and PV.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch

from bench.common import (
    ModelSpec,
    Request,
    build_ours,
    describe_steps,
    machine,
    make_checkpoint,
    make_workload,
    median,
    profile_steps,
    quiet_logs,
    replay_ms,
    run_ours,
)


def matmul_gflops(m: int, k: int, n: int, reps: int, dtype: torch.dtype = torch.float32) -> float:
    """Median GFLOP/s of a [m, k] x [k, n] matmul (weights stored [n, k] as nn.Linear)."""
    a, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    out = torch.empty(m, n, dtype=dtype)
    for _ in range(2):
        torch.mm(a, w.t(), out=out)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        torch.mm(a, w.t(), out=out)
        times.append(time.perf_counter() - t)
    return 2 * m * k * n / median(times) / 1e9


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
    spec: ModelSpec, args: argparse.Namespace
) -> tuple[float, float, float, float]:
    """Run `batch` requests with equal prompts and outputs; over the window in which all of them
    are decoding, return (achieved model FLOP/s, decode tok/s, median forward+sample ms per
    full-batch step inside the engine, the same step replayed alone)."""
    path = make_checkpoint(spec, seed=args.seed)
    engine = build_ours(
        path, not args.no_overlap, args.kv_cache_gb, args.batch, args.max_num_batched_tokens
    )
    await engine.start()
    await run_ours(engine, make_workload(4, (16, 32), (4, 4), spec.vocab, args.seed + 1))
    prof = profile_steps(engine)
    workload = [
        Request(r.prompt, args.output_len)
        for r in make_workload(
            args.batch, (args.prompt_len, args.prompt_len), (1, 1), spec.vocab, args.seed
        )
    ]
    run = await run_ours(engine, workload, desc=f"decode at batch {args.batch}")
    await engine.stop()

    start = max(t.token_times[0] for t in run.timings)  # the last request has joined
    end = min(t.token_times[-1] for t in run.timings)  # the first request is done
    flops, tokens = 0.0, 0
    for t in run.timings:
        for i, stamp in enumerate(t.token_times):
            if start < stamp <= end:
                # token i is sampled from a forward over position prompt_len + i - 1
                flops += spec.token_flops(args.prompt_len + i)
                tokens += 1
    window = end - start
    full = [
        i for i, (b, d) in enumerate(zip(prof.batch, prof.decode_only)) if d and b == args.batch
    ]
    step_ms = 1e3 * median([prof.execute[i] for i in full])
    alone_ms = replay_ms(engine, prof.decode_steps[args.batch])
    print(f"  engine decode-only steps: {describe_steps(prof.summary(True))}")
    return flops / window, tokens / window, step_ms, alone_ms


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", type=int, default=2048, help="square matmul size for the peak")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
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
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet_logs()
    spec = ModelSpec(
        args.layers, args.hidden, args.heads, args.kv_heads, args.intermediate, args.vocab
    )
    print(f"model: {spec.describe()}; {machine()}")

    n = args.size
    peak = matmul_gflops(n, n, n, args.reps)
    print(f"fp32 matmul {n}x{n}x{n}: {peak:.1f} GFLOP/s (median of {args.reps})")
    total_flops = total_time = 0.0
    for name, m, k, nn, count in decode_shapes(spec, args.batch):
        g = matmul_gflops(m, k, nn, args.reps)
        flops = 2 * m * k * nn * count
        total_flops += flops
        total_time += flops / (g * 1e9)
        print(f"  decode shape {name:13s} [{m}, {k}] x [{k}, {nn}] x{count}: {g:6.1f} GFLOP/s")
    shaped = total_flops / total_time / 1e9
    print(
        f"  decode-step matmuls together: {shaped:.1f} GFLOP/s "
        f"({1e3 * total_time:.1f} ms per step of pure matmul)"
    )

    achieved, tok_s, step_ms, alone_ms = asyncio.run(engine_decode(spec, args))
    step_flops = args.batch * spec.token_flops(args.prompt_len + args.output_len)
    overlap = "off" if args.no_overlap else "on"
    print(
        f"engine decode at batch {args.batch} (prompt {args.prompt_len}, output {args.output_len}, "
        f"overlap {overlap}): {tok_s:.1f} tok/s, {achieved / 1e9:.1f} GFLOP/s achieved"
    )
    print(
        f"  forward+sample of a full-batch step: {step_ms:.1f} ms inside the engine, "
        f"{alone_ms:.1f} ms replayed alone "
        f"(= {step_flops / (alone_ms / 1e3) / 1e9:.1f} GFLOP/s)"
    )
    print(f"MFU vs {n}^3 matmul peak:          {100 * achieved / (peak * 1e9):5.1f} %")
    print(f"MFU vs decode-shaped matmul rate: {100 * achieved / (shaped * 1e9):5.1f} %")


if __name__ == "__main__":
    main()

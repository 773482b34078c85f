"""Overlap on vs off: decode-heavy workload on a tiny model, alternating runs in one process.

The forward of both engines runs on `--device-threads` torch threads (default 1): on a CPU
machine that core stands in for the accelerator, and the event loop has the other cores, as
the host CPU has on a GPU node.

python -m bench.overlap [--repeats 5 --requests 64 --output-len 128-256 --device-threads 1]
"""

from __future__ import annotations

import argparse
import asyncio

from bench.common import (
    ModelSpec,
    build_ours,
    describe_steps,
    machine,
    make_checkpoint,
    make_workload,
    median,
    parse_range,
    profile_steps,
    quiet_logs,
    run_ours,
)


async def bench(args: argparse.Namespace) -> None:
    spec = ModelSpec(
        args.layers, args.hidden, args.heads, args.kv_heads, args.intermediate, args.vocab
    )
    path = make_checkpoint(spec, seed=args.seed)
    workload = make_workload(
        args.requests,
        parse_range(args.prompt_len),
        parse_range(args.output_len),
        spec.vocab,
        args.seed,
    )
    print(f"model: {spec.describe()}")
    print(
        f"device {args.device}; forward threads: {args.device_threads or 'all cores'} (both engines)"
    )
    print(
        f"workload: {len(workload)} requests, prompt {args.prompt_len}, output {args.output_len} "
        f"({sum(r.max_tokens for r in workload)} output tokens), seed {args.seed}; {machine()}"
    )
    # Both engines are built (model loaded, KV allocated) before anything is timed.
    engines = {
        flag: build_ours(
            path,
            flag,
            args.kv_cache_gb,
            args.max_num_seqs,
            args.max_num_batched_tokens,
            args.device_threads,
            args.device,
        )
        for flag in (True, False)
    }
    for engine in engines.values():
        await engine.start()
        await run_ours(engine, make_workload(4, (16, 32), (8, 8), spec.vocab, args.seed + 1))
    profiles = {flag: profile_steps(e) for flag, e in engines.items()} if args.profile else None

    tok_s: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(args.repeats):
        for flag in (True, False):
            label = "on " if flag else "off"
            run = await run_ours(engines[flag], workload, desc=f"overlap {label} #{rep + 1}")
            tok_s[flag].append(run.tok_s)
            print(
                f"repeat {rep + 1}: overlap {label} {run.tok_s:7.1f} tok/s ({run.elapsed:.2f} s, "
                f"{run.steps} steps, {1e3 * run.elapsed / run.steps:.1f} ms/step, event-loop CPU "
                f"{1e3 * run.loop_cpu / run.steps:.2f} ms/step)",
                flush=True,
            )
    for engine in engines.values():
        await engine.stop()

    on, off = median(tok_s[True]), median(tok_s[False])
    print(f"\nmedians over {args.repeats} repeats:")
    print(f"  overlap on   {on:8.1f} tok/s")
    print(f"  overlap off  {off:8.1f} tok/s")
    print(f"  on / off     {on / off:8.3f}x")
    pairs = [a / b for a, b in zip(tok_s[True], tok_s[False])]
    print(f"  per-repeat on/off ratios: {', '.join(f'{x:.3f}' for x in pairs)}")
    if profiles is not None:
        for flag, prof in profiles.items():
            label = "on " if flag else "off"
            print(f"  overlap {label} decode-only steps: {describe_steps(prof.summary(True))}")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cpu", help="cpu | cuda | npu (both engines)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", default="16-64")
    p.add_argument("--output-len", default="128-256")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--kv-cache-gb", type=float, default=0.5)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--device-threads",
        type=int,
        default=1,
        help="torch threads of both engines' forward (0 = the engine's default: all cores)",
    )
    p.add_argument("--profile", action="store_true", help="time schedule/prepare/execute per step")
    args = p.parse_args()
    quiet_logs()
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()

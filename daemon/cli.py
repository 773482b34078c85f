"""Command line: `deepinfer serve` runs the HTTP daemon, `deepinfer generate` runs prompts offline."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import structlog

from daemon.config import EngineConfig, ServerConfig
from daemon.logging_setup import LEVELS, setup_logging
from daemon.paths import cache_dir

log = structlog.get_logger(__name__)


def _engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="checkpoint directory (default: the built-in random-weight demo model)",
    )
    g.add_argument("--served-model-name", default=None, help="model name the API answers to")
    g.add_argument("--kv-cache-memory-gb", type=float, default=d.kv_cache_memory_gb)
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument(
        "--no-overlap",
        action="store_true",
        help="schedule each step only after the previous one's outputs are processed",
    )
    g.add_argument("--dtype", default=d.dtype, help="auto | float32 | float16 | bfloat16")
    g.add_argument("--device", default=d.device, help="auto | cpu | cuda | npu")
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument(
        "--cpu-threads",
        type=int,
        default=d.cpu_threads,
        help="torch threads on a CPU device (0: all cores, one left to the event loop with overlap)",
    )
    g.add_argument(
        "--no-prefix-caching", action="store_true", help="recompute every prompt from scratch"
    )
    g.add_argument(
        "--swa-miss-policy",
        default=d.swa_miss_policy,
        choices=("replay", "exact"),
        help="DeepSeek-V4, cached blocks but no sliding-window state: bounded replay or exact",
    )
    g.add_argument("--swa-cache-memory-gb", type=float, default=d.swa_cache_memory_gb)
    g.add_argument("--swa-cache-ttl-s", type=float, default=d.swa_cache_ttl_s)
    g.add_argument(
        "--host-cache-memory-gb",
        type=float,
        default=d.host_cache_memory_gb,
        help="host-memory tier of the prefix cache (0: off)",
    )
    g.add_argument(
        "--kv-store-dir",
        default=None,
        help="block store directory shared by all daemons (a 3FS mount; default: "
        "$DEEPINFER_CACHE/kv-store, i.e. ~/.cache/deepinfer/kv-store)",
    )
    g.add_argument("--no-kv-store", action="store_true", help="keep no blocks on disk")
    g.add_argument(
        "--kv-store-fsync", action="store_true", help="fsync each block before publishing it"
    )
    g.add_argument("--kv-store-io-threads", type=int, default=d.kv_store_io_threads)
    g.add_argument(
        "--kv-store-capacity-gb",
        type=float,
        default=d.kv_store_capacity_gb,
        help="evict above the high watermark of this (0: the file system's size)",
    )
    g.add_argument("--kv-store-high-watermark", type=float, default=d.kv_store_high_watermark)
    g.add_argument("--kv-store-low-watermark", type=float, default=d.kv_store_low_watermark)
    g.add_argument("--kv-store-gc-interval-s", type=float, default=d.kv_store_gc_interval_s)
    g.add_argument(
        "--traffic-class",
        action="append",
        default=[],
        metavar="NAME=DURATION",
        help="block-store retention of a traffic class, e.g. agent=3d, batch=12h "
        "(defaults: chat=7d, agent=3d; 0: never stored)",
    )
    g.add_argument("--log-level", default="info", choices=LEVELS)
    g.add_argument("--log-format", default="console", choices=("console", "json"))


def _engine_config(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=a.model,
        served_model_name=a.served_model_name,
        device=a.device,
        dtype=a.dtype,
        kv_cache_memory_gb=a.kv_cache_memory_gb,
        block_size=a.block_size,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_model_len=a.max_model_len,
        overlap=not a.no_overlap,
        cpu_threads=a.cpu_threads,
        seed=a.seed,
        prefix_caching=not a.no_prefix_caching,
        swa_miss_policy=a.swa_miss_policy,
        swa_cache_memory_gb=a.swa_cache_memory_gb,
        swa_cache_ttl_s=a.swa_cache_ttl_s,
        host_cache_memory_gb=a.host_cache_memory_gb,
        kv_store_dir=None if a.no_kv_store else a.kv_store_dir or str(cache_dir() / "kv-store"),
        kv_store_fsync=a.kv_store_fsync,
        kv_store_io_threads=a.kv_store_io_threads,
        kv_store_capacity_gb=a.kv_store_capacity_gb,
        kv_store_high_watermark=a.kv_store_high_watermark,
        kv_store_low_watermark=a.kv_store_low_watermark,
        kv_store_gc_interval_s=a.kv_store_gc_interval_s,
        traffic_classes=a.traffic_class,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    s = ServerConfig()
    serve.add_argument("--host", default=s.host)
    serve.add_argument("--port", type=int, default=s.port)
    serve.add_argument("--max-body-bytes", type=int, default=s.max_body_bytes)
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=s.shutdown_timeout,
        help="seconds in-flight requests get to finish on SIGTERM",
    )
    serve.add_argument(
        "--api-key",
        default=s.api_key,
        help="require this key (Authorization: Bearer <key> or x-api-key: <key>)",
    )
    serve.add_argument(
        "--max-waiting",
        type=int,
        default=s.max_waiting,
        help="answer 429 once this many requests wait for the engine (0 = no limit)",
    )
    _engine_args(serve)

    gen = sub.add_parser("generate", help="run prompts through the engine and print the outputs")
    gen.add_argument(
        "--prompt",
        action="append",
        required=True,
        help="prompt text (repeat for several; they run as one batch)",
    )
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--ignore-eos", action="store_true")
    _engine_args(gen)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    if args.model is None:
        log.warning(
            "demo_model",
            note="no --model given: using the built-in RANDOM-WEIGHT demo "
            "model; its output is noise, useful only to exercise the daemon",
        )
    try:
        if args.command == "serve":
            from daemon.api.server import run_server

            server_cfg = ServerConfig(
                host=args.host,
                port=args.port,
                max_body_bytes=args.max_body_bytes,
                shutdown_timeout=args.shutdown_timeout,
                api_key=args.api_key,
                max_waiting=args.max_waiting,
            )
            run_server(_engine_config(args), server_cfg)
        else:
            import uvloop

            uvloop.run(_generate(args))
    except KeyboardInterrupt:
        return 130
    return 0


async def _generate(args: argparse.Namespace) -> None:
    from daemon.build import build_engine
    from daemon.loop.request import SamplingParams

    engine, name = build_engine(_engine_config(args))
    if engine.tokenizer is None:
        raise SystemExit(f"{name} has no tokenizer.json; generate needs text prompts encoded")
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sample_seed,
        ignore_eos=args.ignore_eos,
    )
    await engine.start()
    try:
        start = time.monotonic()

        async def run(prompt: str) -> tuple[str, int, str]:
            text, tokens, reason = [], 0, ""
            async for out in engine.generate(engine.tokenizer.encode(prompt), params):
                text.append(out.new_text)
                tokens = out.num_output_tokens
                reason = out.finish_reason.value if out.finish_reason else ""
            return "".join(text), tokens, reason

        results = await asyncio.gather(*(run(p) for p in args.prompt))
        seconds = time.monotonic() - start
    finally:
        await engine.stop()
    for i, (prompt, (text, tokens, reason)) in enumerate(zip(args.prompt, results, strict=True)):
        print(f"--- [{i}] prompt: {prompt!r}  ({tokens} tokens, finish={reason})")
        print(text)
    total = sum(r[1] for r in results)
    log.info(
        "generated",
        model=name,
        prompts=len(results),
        tokens=total,
        seconds=round(seconds, 3),
        tokens_per_s=round(total / max(seconds, 1e-9), 1),
    )


if __name__ == "__main__":
    sys.exit(main())

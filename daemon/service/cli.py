"""Command line: `deepinfer serve` runs the HTTP daemon, `deepinfer generate` runs prompts offline,
`deepinfer bench serve` benchmarks a running server."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import structlog

from daemon.api.http.config import ServerConfig
from daemon.benchmark.options import add_serve_arguments
from daemon.build.config import EngineConfig
from daemon.build.paths import cache_dir
from daemon.build.startup import EXIT_STARTUP_FAILED, StartupError
from daemon.kv.swa_policy import POLICIES
from daemon.service.logs import add_secret, setup_logging
from daemon.service.settings import LOG_FORMATS, LOG_LEVELS, ConfigError, Settings, load_settings

S = argparse.SUPPRESS  # flags not given leave the settings file and environment alone

log = structlog.get_logger(__name__)


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=S,
        help="checkpoint directory (default: the built-in random-weight demo model)",
    )
    g.add_argument("--served-model-name", default=S, help="model name the API answers to")
    g.add_argument("--kv-cache-memory-gb", type=float, default=S)
    g.add_argument("--max-num-seqs", type=int, default=S)
    g.add_argument("--max-num-batched-tokens", type=int, default=S)
    g.add_argument("--max-model-len", type=int, default=S)
    g.add_argument("--block-size", type=int, default=S)
    overlap = g.add_mutually_exclusive_group()
    overlap.add_argument(
        "--overlap",
        action="store_true",
        default=S,
        help="schedule step N+1 while step N runs, also on a CPU whose forward takes every core "
        "(default: on with an accelerator, or where a core is left to the event loop)",
    )
    overlap.add_argument(
        "--no-overlap",
        action="store_true",
        default=S,
        help="schedule each step only after the previous one's outputs are processed",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        default=S,
        help="run every step eagerly (no CUDA graphs for decode steps)",
    )
    g.add_argument("--dtype", default=S, help="auto | float32 | float16 | bfloat16")
    g.add_argument("--device", default=S, help="auto | cpu | cuda | npu")
    g.add_argument("--seed", type=int, default=S)
    g.add_argument(
        "--cpu-threads",
        type=int,
        default=S,
        help="torch threads on a CPU device (0: all cores; with overlap on more than 4 cores, one is left to the event loop)",
    )
    g.add_argument(
        "--no-prefix-caching",
        action="store_true",
        default=S,
        help="recompute every prompt from scratch",
    )
    g.add_argument(
        "--swa-miss-policy",
        default=S,
        choices=POLICIES,
        help="DeepSeek-V4, cached blocks but no sliding-window state: replay the window's reach "
        "(layers x (window - 1) tokens, exact), only the last window (the seed's bounded "
        "replay, approximate) or recompute from the last stored state",
    )
    g.add_argument("--swa-cache-memory-gb", type=float, default=S)
    g.add_argument("--swa-cache-ttl-s", type=float, default=S)
    g.add_argument(
        "--host-cache-memory-gb",
        type=float,
        default=S,
        help="host-memory tier of the prefix cache (0: off)",
    )
    g.add_argument(
        "--kv-store-dir",
        default=S,
        help="block store directory shared by all daemons (a 3FS mount; default: "
        "$DEEPINFER_CACHE/kv-store, i.e. ~/.cache/deepinfer/kv-store)",
    )
    g.add_argument("--no-kv-store", action="store_true", default=S, help="keep no blocks on disk")
    g.add_argument(
        "--kv-store-fsync",
        action="store_true",
        default=S,
        help="fsync each block before publishing it",
    )
    g.add_argument("--kv-store-io-threads", type=int, default=S)
    g.add_argument(
        "--kv-store-capacity-gb",
        type=float,
        default=S,
        help="evict above the high watermark of this (0: the file system's size)",
    )
    g.add_argument("--kv-store-high-watermark", type=float, default=S)
    g.add_argument("--kv-store-low-watermark", type=float, default=S)
    g.add_argument("--kv-store-gc-interval-s", type=float, default=S)
    g.add_argument(
        "--kv-store-read-timeout-s",
        type=float,
        default=S,
        help="a block read not back by then is a miss (a hung network file system)",
    )
    g.add_argument(
        "--traffic-class",
        action="append",
        default=S,
        metavar="NAME=DURATION",
        help="block-store retention of a traffic class, e.g. agent=3d, batch=12h "
        "(defaults: chat=7d, agent=3d; 0: never stored)",
    )
    m = p.add_argument_group("MoE expert parallelism (one daemon process per rank)")
    m.add_argument("--ep-size", type=int, default=S, help="ranks in the group (1: off)")
    m.add_argument("--ep-rank", type=int, default=S)
    m.add_argument("--ep-master", default=S, help="host:port of rank 0 (default 127.0.0.1:29500)")
    m.add_argument("--ep-slots-per-rank", type=int, default=S, help="0: ceil(experts/ranks)+1")
    m.add_argument("--moe-stats-interval", type=int, default=S, help="steps (default 1000)")
    m.add_argument(
        "--moe-rebalance-interval", type=int, default=S, help="steps (default 10000; 0: on command)"
    )
    m.add_argument("--moe-stats-window", type=int, default=S, help="samples (default 10)")
    g.add_argument("--log-level", default=S, choices=LOG_LEVELS)
    g.add_argument("--log-format", default=S, choices=LOG_FORMATS, help="auto: JSON unless a TTY")
    g.add_argument("--log-file", default=S, help="append logs here (SIGHUP reopens it)")


# flags whose config key or value differs from the flag (dest -> section, key, value)
_RENAMED: dict[str, tuple[str, str, Callable[[Any], Any]]] = {
    "no_overlap": ("engine", "overlap", lambda v: not v),
    "no_prefix_caching": ("engine", "prefix_caching", lambda v: not v),
    "no_kv_store": ("engine", "kv_store_dir", lambda v: ""),
    "traffic_class": ("engine", "traffic_classes", lambda v: v),
    "log_level": ("logging", "level", lambda v: v),
    "log_format": ("logging", "format", lambda v: v),
    "log_file": ("logging", "file", lambda v: v),
}
ADMIN_COMMANDS = {
    "status": "engine, cache and MoE state",
    "expert-load": "per MoE layer: expert loads, rank loads, imbalance (max/mean)",
    "rebalance-now": "place the experts anew from the load window, live",
    "set-intervals": "MoE statistics / rebalance intervals (rank 0)",
    "drain": "stop admitting requests (503); running ones finish",
    "resume": "admit requests again",
}


def _overrides(a: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """{section: {key: value}} for the flags given on the command line."""
    out: dict[str, dict[str, Any]] = {"engine": {}, "server": {}, "logging": {}}
    engine_keys = {f.name for f in dataclasses.fields(EngineConfig)}
    for dest, value in vars(a).items():
        if dest in _RENAMED:
            section, key, convert = _RENAMED[dest]
            out[section][key] = convert(value)
        elif dest in engine_keys:
            out["engine"][dest] = value
        elif dest in {f.name for f in dataclasses.fields(ServerConfig)}:
            out["server"][dest] = value
    return out


def _settings(a: argparse.Namespace) -> Settings:
    # serving keeps blocks on disk unless told otherwise (`kv_store_dir = ""` turns it off)
    base = {"engine": {"kv_store_dir": str(cache_dir() / "kv-store")}}
    return load_settings(getattr(a, "config", None), os.environ, _overrides(a), base=base)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    serve.add_argument(
        "--config",
        default=None,
        help="TOML settings file ([engine], [server], [logging]); environment variables "
        "DEEPINFER_<SECTION>_<KEY> and flags override it",
    )
    serve.add_argument("--host", default=S)
    serve.add_argument("--port", type=int, default=S)
    serve.add_argument("--max-body-bytes", type=int, default=S)
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=S,
        help="seconds in-flight requests get to finish on SIGTERM",
    )
    serve.add_argument(
        "--api-key",
        default=S,
        help="require this key (Authorization: Bearer <key> or x-api-key: <key>)",
    )
    serve.add_argument(
        "--admin-socket",
        default=S,
        help="serve the admin API on this Unix socket (mode 0600); see `deepinfer admin`",
    )
    serve.add_argument(
        "--max-waiting",
        type=int,
        default=S,
        help="answer 429 once this many requests wait for the engine (0 = no limit)",
    )
    serve.add_argument(
        "--thinking-default",
        default=S,
        choices=("auto", "on", "off"),
        help="DeepSeek-V4, requests that do not say whether to think (auto: Messages no, "
        "Chat Completions and Responses yes, as Anthropic's and DeepSeek's APIs do)",
    )
    serve.add_argument(
        "--tool-call-parser",
        default=S,
        help="dense models' tool-call format: auto (from the chat template) | hermes | "
        "llama3_json | none",
    )
    serve.add_argument(
        "--response-store-max-count",
        type=int,
        default=S,
        help="stored Responses kept for GET and previous_response_id (0 = none; default 10000)",
    )
    serve.add_argument("--response-store-memory-gb", type=float, default=S, help="default 0.5")
    serve.add_argument(
        "--response-store-ttl-s",
        type=float,
        default=S,
        help="a stored response goes this long after its last use (default 3600)",
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

    config = sub.add_parser("config", help="settings files")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = config_sub.add_parser(
        "check", help="validate a settings file (with the environment's overrides)"
    )
    check.add_argument("file")

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bench_serve = bench_sub.add_parser(
        "serve",
        help="drive an OpenAI-compatible server over HTTP (like `vllm bench serve`): "
        "throughput, TTFT/TPOT/ITL/E2E percentiles, goodput",
    )
    add_serve_arguments(bench_serve)

    admin = sub.add_parser("admin", help="talk to a running daemon's admin socket")
    admin.add_argument("--socket", required=True, help="the daemon's admin socket path")
    admin_sub = admin.add_subparsers(dest="admin_command", required=True)
    for name, text in ADMIN_COMMANDS.items():
        cmd = admin_sub.add_parser(name, help=text)
        if name == "set-intervals":
            cmd.add_argument("--stats", type=int, help="steps between expert-load samples")
            cmd.add_argument("--rebalance", type=int, help="steps between placements (0: off)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "config":
        return _config_check(args.file)
    if args.command == "bench":
        from daemon.benchmark.serve import main as bench_serve

        return bench_serve(args)
    if args.command == "admin":
        from daemon.service.admin_client import run_admin

        return run_admin(args.socket, args.admin_command, args)
    try:
        settings = _settings(args)
    except ConfigError as e:
        print(f"deepinfer: invalid settings: {e}", file=sys.stderr)
        return 2
    try:
        setup_logging(settings.logging.level, settings.logging.format, settings.logging.file)
        add_secret(settings.server.api_key)
    except OSError as e:
        print(f"deepinfer: cannot open the log file {e.filename}: {e.strerror}", file=sys.stderr)
        return EXIT_STARTUP_FAILED
    if not settings.engine.model:
        log.warning(
            "demo_model",
            note="no model given: using the built-in RANDOM-WEIGHT demo "
            "model; its output is noise, useful only to exercise the daemon",
        )
    try:
        if args.command == "serve":
            from daemon.service.daemon import run_server

            return run_server(settings, reload=lambda: _settings(args))
        import uvloop

        uvloop.run(_generate(args, settings.engine))
    except KeyboardInterrupt:
        return 130
    except StartupError as e:
        log.error("startup_failed", error=str(e))
        return EXIT_STARTUP_FAILED
    return 0


def _config_check(path: str) -> int:
    try:
        settings = load_settings(path, os.environ)
    except ConfigError as e:
        print(f"{path}: invalid: {e}", file=sys.stderr)
        return 2
    print(f"{path}: ok")
    for section in ("engine", "server", "logging"):
        for key, value in vars(getattr(settings, section)).items():
            shown = "(set)" if key == "api_key" and value else value
            print(f"  {section}.{key} = {shown!r}")
    return 0


async def _generate(args: argparse.Namespace, engine_cfg: EngineConfig) -> None:
    from daemon.build.engine import build_engine
    from daemon.loop.request import SamplingParams

    engine, name = build_engine(engine_cfg)
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

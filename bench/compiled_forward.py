"""The compiled CPU decode forward against the eager one: decode tok/s and TPOT at several
concurrencies (one process, both engines, alternating repeats, medians), and the start-up time
of the demo model with a cold and a warm inductor cache (fresh processes).

    python -m bench.compiled_forward [--model /tmp/smollm2-hf] [--dtypes bfloat16,float32]
        [--concurrency 1,16,64] [--repeats 3] [--startup-only | --no-startup]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import make_workload, median, percentile, quiet_logs, run_ours

STARTUP = """
import json, sys, time
t0 = time.perf_counter()
from daemon.build.config import EngineConfig
from daemon.build.engine import build_engine
t1 = time.perf_counter()
engine, _ = build_engine(EngineConfig(enforce_eager=sys.argv[1] == "eager"))
print(json.dumps({"import_s": t1 - t0, "build_s": time.perf_counter() - t1}))
"""


def build(model: str | None, dtype: str, eager: bool):
    from daemon.build.config import EngineConfig
    from daemon.build.engine import build_engine

    cfg = EngineConfig(model=model, dtype=dtype, enforce_eager=eager, max_num_seqs=128)
    return build_engine(cfg)[0]


async def decode_runs(args: argparse.Namespace, dtype: str) -> list[str]:
    engines = {"eager": build(args.model, dtype, True), "compiled": build(args.model, dtype, False)}
    for engine in engines.values():
        await engine.start()
    vocab = engines["eager"].runner.vocab_size
    lines = []
    try:
        for c in args.concurrency:
            tok_s: dict[str, list[float]] = {name: [] for name in engines}
            tpot: dict[str, list[float]] = {name: [] for name in engines}
            for r in range(args.repeats + 1):  # the first round warms both up, not counted
                work = make_workload(
                    c, (args.prompt_len,) * 2, (args.output_len,) * 2, vocab, 100 * c + r
                )
                order = list(engines) if r % 2 == 0 else list(engines)[::-1]
                for name in order:
                    run = await run_ours(engines[name], work)
                    if r:
                        tok_s[name].append(run.tok_s)
                        tpot[name].extend(t.tpot for t in run.timings if t.tpot is not None)
            e, k = median(tok_s["eager"]), median(tok_s["compiled"])
            lines.append(
                f"| {dtype} | {c} | {e:.1f} | {k:.1f} | {k / e:.2f}× | "
                f"{1e3 * percentile(tpot['eager'], 50):.1f} | "
                f"{1e3 * percentile(tpot['compiled'], 50):.1f} |"
            )
            print(lines[-1], flush=True)
    finally:
        for engine in engines.values():
            await engine.stop()
    return lines


def startup(kind: str, cache: Path) -> dict[str, float]:
    """A fresh process building the demo engine, inductor's caches in `cache`."""
    env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": str(cache)}
    t0 = time.perf_counter()
    cmd = [sys.executable, "-c", STARTUP, kind]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - t0
    return result


def startup_lines() -> list[str]:
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        for label, kind in (("eager", "eager"), ("compiled, cold", "compiled")) + (
            ("compiled, warm", "compiled"),
        ) * 2:
            r = startup(kind, cache)
            lines.append(f"| {label} | {r['build_s']:.1f} | {r['process_s']:.1f} |")
            print(lines[-1], flush=True)
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint or GGUF (default: the demo SmolLM2)")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--startup-only", action="store_true")
    p.add_argument("--no-startup", action="store_true")
    args = p.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    quiet_logs()
    if not args.startup_only:
        print(
            "| dtype | concurrency | eager tok/s | compiled tok/s | ratio | eager TPOT ms |"
            " compiled TPOT ms |"
        )
        print("|---|---|---|---|---|---|---|")
        for dtype in args.dtypes.split(","):
            asyncio.run(decode_runs(args, dtype))
    if not args.no_startup:
        print("\n| start-up (demo model) | build_engine s | process s |\n|---|---|---|")
        startup_lines()


if __name__ == "__main__":
    main()

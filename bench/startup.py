"""Start-up of the demo model: `deepinfer generate --prompt Hello --max-tokens 2` with an empty
DEEPINFER_CACHE (cold), then again over it (warm), for each checkout in turn, alternating; the
phases of each start from the daemon's log, medians.

    python -m bench.startup [--checkouts /work/main .] [--repeats 2] [--warm 1] [--out F.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

# the phases, each from the log's events: (label, event that ends it, event that starts it)
SPANS = (
    ("imports, settings", "demo_model", None),
    ("model load", "model_loaded", "demo_model"),
    ("to engine ready", "engine_ready", "model_loaded"),
)
COLUMNS = (
    "imports, settings",
    "model load",
    "kernels",
    "forward graphs",
    "to engine ready",
    "ready",
    "generate + exit",
    "process",
)


def run_once(checkout: Path, cache: Path) -> dict[str, float]:
    """One `generate` in a fresh process over `cache`: seconds per phase."""
    env = os.environ | {
        "DEEPINFER_CACHE": str(cache),
        "PYTHONPATH": str(checkout),
        # named: before 2026-12-04 the engine left it at torch's default, shared under /tmp
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
    }
    env.pop("TORCH_EXTENSIONS_DIR", None)  # under DEEPINFER_CACHE, as a user's
    cmd = [sys.executable, "-m", "daemon", "generate", "--prompt", "Hello", "--max-tokens", "2"]
    started = time.time()
    done = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True, timeout=900)
    process = time.time() - started
    if done.returncode:
        raise SystemExit(f"{checkout}: exit {done.returncode}\n{done.stderr[-3000:]}")
    events: dict[str, dict] = {}
    for line in (done.stdout + done.stderr).splitlines():
        if line.startswith("{"):
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            events.setdefault(event.get("event", ""), event)

    def at(name: str) -> float:
        return datetime.fromisoformat(events[name]["timestamp"]).timestamp()

    out: dict[str, float] = {}
    for label, end, start in SPANS:
        out[label] = at(end) - (at(start) if start else started)
    out["kernels"] = events.get("cpu_kernels_loaded", {}).get("seconds", float("nan"))
    forward = events.get("decode_forward_compiled", {})
    out["forward graphs"] = forward.get("seconds", float("nan"))
    out["loaded"] = forward.get("loaded", float("nan"))
    out["ready"] = at("engine_ready") - started
    out["generate + exit"] = process - out["ready"]
    out["process"] = process
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--checkouts", nargs="+", default=["."], help="repository roots (PYTHONPATH)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--warm", type=int, default=1, help="warm starts after each cold one")
    p.add_argument("--out", default=None, help="also write the tables here (markdown)")
    args = p.parse_args()
    checkouts = [Path(c).resolve() for c in args.checkouts]
    rows: dict[tuple[str, str], list[dict[str, float]]] = {}
    lines = [f"load before: {os.getloadavg()[0]:.2f}", ""]
    lines += ["| run | checkout | start | " + " | ".join(COLUMNS) + " | graphs loaded |"]
    lines += ["|---" * (len(COLUMNS) + 4) + "|"]
    print("\n".join(lines), flush=True)
    for repeat in range(args.repeats):
        # alternate which checkout goes first
        order = checkouts if repeat % 2 == 0 else checkouts[::-1]
        for checkout in order:
            with tempfile.TemporaryDirectory(prefix="deepinfer-startup-") as tmp:
                for i, kind in enumerate(["cold"] + ["warm"] * args.warm):
                    r = run_once(checkout, Path(tmp))
                    rows.setdefault((str(checkout), kind), []).append(r)
                    cells = " | ".join(f"{r[c]:.1f}" for c in COLUMNS)
                    line = (
                        f"| {repeat + 1}.{i + 1} | {checkout} | {kind} | {cells} "
                        f"| {r['loaded']:.0f} |"
                    )
                    lines.append(line)
                    print(line, flush=True)
    lines += ["", f"load after: {os.getloadavg()[0]:.2f}", "", "medians:", ""]
    lines += ["| checkout | start | " + " | ".join(COLUMNS) + " |"]
    lines += ["|---" * (len(COLUMNS) + 2) + "|"]
    for (checkout, kind), runs in rows.items():
        cells = " | ".join(f"{statistics.median(r[c] for r in runs):.1f}" for c in COLUMNS)
        lines.append(f"| {checkout} | {kind} | {cells} |")
    print("\n".join(lines[-len(rows) - 6 :]), flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

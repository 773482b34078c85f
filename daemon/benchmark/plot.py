"""Latency CDFs (TTFT, TPOT, E2E) and output tokens/s over time of one or more runs (matplotlib).

python -m daemon.benchmark.plot A.json B.json -o compare.png   # overlay --result-json files
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MISSING = (
    "--plot needs matplotlib, which is in deepinfer's `bench` extra: "
    "pip install 'deepinfer[bench]' (or pip install matplotlib)"
)


@dataclass
class PlotRun:
    label: str
    ttft_ms: list[float]
    tpot_ms: list[float]
    e2e_ms: list[float]
    tokens_per_s: list[float]  # 1 s bins from the run's start


def from_records(label: str, records: list[dict[str, Any]], bin_s: float = 1.0) -> PlotRun:
    """From per-request records as the result file holds them (RequestRecord.to_json)."""
    ok = [r for r in records if r["ok"]]
    chunks = [(t, n) for r in ok for t, n in zip(r["chunk_s"], r["chunk_tokens"])]
    bins = [0.0] * (int(max((t for t, _ in chunks), default=0) // bin_s) + 1) if chunks else []
    for t, n in chunks:
        bins[int(t // bin_s)] += n / bin_s
    return PlotRun(
        label,
        [r["ttft_s"] * 1000 for r in ok if r["ttft_s"] is not None],
        [r["tpot_s"] * 1000 for r in ok if r["tpot_s"] is not None],
        [r["e2e_s"] * 1000 for r in ok if r["e2e_s"] is not None],
        bins,
    )


def plot(runs: list[PlotRun], path: str | Path, title: str = "") -> None:
    """Four panels: CDFs of TTFT, TPOT and E2E latency, and output tokens/s per 1 s bin."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(MISSING) from None
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("E2E latency", "e2e_ms"))
    for ax, (name, attr) in zip(axes.flat, panels):
        for run in runs:
            values = sorted(getattr(run, attr))
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, ys, where="post", label=run.label)
        ax.set_xscale("log")
        ax.set_xlabel(f"{name} (ms, log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{name} CDF")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    ax = axes.flat[3]
    for run in runs:
        xs = list(range(len(run.tokens_per_s)))
        ax.step(xs, run.tokens_per_s, where="post", label=run.label)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens/s (1 s bins)")
    ax.set_title("output throughput over time (the last bin is partial)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="--result-json files of `deepinfer bench serve`")
    ap.add_argument("-o", "--output", required=True, help="PNG path")
    ap.add_argument("--title", default="")
    ap.add_argument("--labels", nargs="+", default=None, help="one per file (default: its label)")
    args = ap.parse_args()
    if args.labels and len(args.labels) != len(args.results):
        ap.error("--labels needs one label per result file")
    runs = []
    for i, file in enumerate(args.results):
        data = json.loads(Path(file).read_text())
        label = args.labels[i] if args.labels else data["config"].get("label") or Path(file).stem
        runs.append(from_records(label, data["requests"]))
    plot(runs, args.output, args.title)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

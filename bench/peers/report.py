"""The comparison's outputs: medians over repeats per (system, concurrency), a markdown table
with ratios against deepinfer, the JSON file, a PNG plot (matplotlib, optional)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import median
from bench.peers.floor import Floor

BASELINE = "deepinfer"
MISSING_MPL = "matplotlib not installed (the `bench` extra): no plot"


@dataclass
class Row:
    system: str
    concurrency: int
    repeats: int
    completed: int  # per repeat, the fewest
    failed: int  # over all repeats
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    ours_vs_tok_s: float | None = None  # deepinfer's output tok/s / this system's
    ours_vs_tpot: float | None = None  # this system's TPOT p50 / deepinfer's (>1: we are faster)
    floor_tpot_ms: float | None = None  # the weight-read floor of what this system reads
    tpot_vs_floor: float | None = None  # TPOT p50 / that floor (1.0: at the floor)


def rows(
    runs: list[dict[str, Any]],
    floor: Floor | None = None,
    dtype: str = "",
    dtypes: dict[str, str] | None = None,
) -> list[Row]:
    """`runs`: {"system", "concurrency", "repeat", "summary"} each; medians over repeats;
    with a `floor`, each row's TPOT against the floor of the weights it reads in `dtype`
    (`dtypes`: a system's own, where it serves another)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["system"], r["concurrency"]), []).append(r["summary"])
    out = []
    for (system, conc), sums in groups.items():
        out.append(
            Row(
                system,
                conc,
                len(sums),
                min(s["completed"] for s in sums),
                sum(s["failed"] for s in sums),
                _median(s["output_throughput"] for s in sums),
                _median(s["ttft_ms"]["median"] for s in sums),
                _median(s["ttft_ms"]["p99"] for s in sums),
                _median(s["tpot_ms"]["median"] for s in sums),
                _median(s["tpot_ms"]["p99"] for s in sums),
            )
        )
    base = {r.concurrency: r for r in out if r.system == BASELINE}
    for r in out:
        if (b := base.get(r.concurrency)) is not None:
            r.ours_vs_tok_s = _ratio(b.output_tok_s, r.output_tok_s)
            r.ours_vs_tpot = _ratio(r.tpot_p50_ms, b.tpot_p50_ms)
        served = (dtypes or {}).get(r.system, dtype)
        if floor is not None and (f := floor.for_system(r.system, served)) is not None:
            r.floor_tpot_ms, r.tpot_vs_floor = f, _ratio(r.tpot_p50_ms, f)
    return sorted(out, key=lambda r: (r.concurrency, r.system != BASELINE, r.system))


def table(rs: list[Row]) -> str:
    head = (
        "| system | conc. | output tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | "
        "deepinfer ÷ system, tok/s | system ÷ deepinfer, TPOT p50 | completed / failed | "
        "floor TPOT | TPOT p50 ÷ floor |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in rs:
        lines.append(
            f"| {r.system} | {r.concurrency} | {r.output_tok_s:.1f} | {_ms(r.ttft_p50_ms)} | "
            f"{_ms(r.ttft_p99_ms)} | {_ms(r.tpot_p50_ms)} | {_ms(r.tpot_p99_ms)} | "
            f"{_x(r.ours_vs_tok_s)} | {_x(r.ours_vs_tpot)} | {r.completed} / {r.failed} | "
            f"{_ms(r.floor_tpot_ms)} | {_x(r.tpot_vs_floor)} |"
        )
    return "\n".join(lines)


def markdown(rs: list[Row], floor: Floor | None) -> str:
    """The table, then the floor's line."""
    return table(rs) + "\n\n" + describe_floor(floor)


def describe_floor(floor: Floor | None) -> str:
    """One line: the copy rate and each format's weight bytes and floor TPOT."""
    if floor is None:
        return "weight-read floor: no checkpoint to count"
    parts = ", ".join(
        f"{k} {floor.weight_bytes[k] / 1e6:.0f} MB -> {v:.1f} ms" for k, v in floor.tpot_ms.items()
    )
    return (
        f"weight-read floor (weights a token reads / {floor.copy_gb_s:.1f} GB/s, this machine's "
        f"copy rate in this run): {parts}"
    )


def plot(rs: list[Row], path: Path, title: str) -> bool:
    """Output tok/s and TPOT p50 against concurrency, a line per system; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (tput, tpot) = plt.subplots(1, 2, figsize=(11, 4))
    for system in dict.fromkeys(r.system for r in rs):
        mine = sorted((r for r in rs if r.system == system), key=lambda r: r.concurrency)
        x = [r.concurrency for r in mine]
        tput.plot(x, [r.output_tok_s for r in mine], marker="o", label=system)
        tpot.plot(x, [r.tpot_p50_ms for r in mine], marker="o", label=system)
    ticks = sorted({r.concurrency for r in rs})
    for ax, label in ((tput, "output tok/s"), (tpot, "TPOT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _median(xs: Any) -> float:
    return median([x for x in xs if x is not None])


def _ratio(a: float, b: float) -> float | None:
    return a / b if b and b == b and a == a else None  # x == x: not NaN


def _ms(v: float | None) -> str:
    return "–" if v is None or v != v else f"{v:.0f} ms" if v >= 10 else f"{v:.1f} ms"


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}×"

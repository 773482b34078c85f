"""bench.spec_decode's outputs: medians over repeats per (workload, concurrency, arm), the
ratios issue 20 asks for against their targets (of the medians, and paired: the median of
each repeat's ratio, its arms run back to back, with its sign-test interval), acceptance by
position and the calibration table summed over a workload's runs, as markdown; the PNG through
bench.peers.report."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.peers import report as peers_report
from bench.spec.counters import SpecCounters

ARMS = ("none", "fixed", "adaptive")
ARM_NAMES = {"none": "no speculation", "fixed": "fixed k=5", "adaptive": "adaptive"}
# issue 20's targets
ADAPTIVE_VS_FIXED = 1.06  # averaged over the grid
ADAPTIVE_VS_NONE = 1.0  # at every point
EDIT_C1_VS_NONE = 1.5  # workload (a) at concurrency 1
INTERVAL_LEVEL = 0.95  # of the paired ratios' median interval


@dataclass
class Point:
    workload: str
    concurrency: int
    arm: str
    repeats: int
    completed: int  # per repeat, the fewest
    failed: int  # over all repeats
    output_tok_s: float  # median over repeats
    tpot_p50_ms: float
    ttft_p50_ms: float
    vs_none: float | None = None  # output tok/s / no speculation's, same workload and conc.
    vs_fixed: float | None = None  # adaptive only: / fixed k=5's
    # the median over repeats of each repeat's ratio: its servers, its arms back to back, so a
    # slow spell of the machine slows both sides of a ratio
    vs_none_paired: float | None = None
    vs_fixed_paired: float | None = None
    # the interval that holds the median of the paired ratios with INTERVAL_LEVEL confidence
    # (order statistics, a sign test: no assumption on the noise's shape); None under 6 repeats
    vs_none_interval: tuple[float, float] | None = None
    mean_accepted_length: float | None = None  # over the repeats' runs together
    acceptance_rate: float | None = None
    budget_mean: float | None = None


@dataclass
class Verdict:
    adaptive_vs_fixed_mean: float | None  # the mean of adaptive / fixed over the grid
    adaptive_vs_none_min: float | None
    adaptive_vs_none_min_at: str | None  # the point where it is lowest
    edit_c1_vs_none: float | None  # adaptive / none on (a) at concurrency 1
    paired: Verdict | None = None  # the same of the paired ratios
    # paired only: the points whose interval lies wholly under 1.0 (adaptive costs throughput
    # there beyond the noise), of `with_interval` points that have one
    below_none: list[str] | None = None
    with_interval: int = 0

    def lines(self, label: str = "") -> list[str]:
        at = self.adaptive_vs_none_min_at or "–"
        lines = [
            _target(
                f"adaptive ÷ fixed k=5{label}, mean over the grid",
                self.adaptive_vs_fixed_mean,
                ADAPTIVE_VS_FIXED,
            ),
            _target(
                f"adaptive ÷ no speculation{label}, lowest point ({at})",
                self.adaptive_vs_none_min,
                ADAPTIVE_VS_NONE,
            ),
            _target(
                f"adaptive ÷ no speculation{label}, edit at concurrency 1",
                self.edit_c1_vs_none,
                EDIT_C1_VS_NONE,
            ),
        ]
        if self.below_none is not None:
            lines.append(self._below_line())
        if self.paired is not None:
            lines += self.paired.lines(", paired (the median of each repeat's ratio)")
        return lines

    def _below_line(self) -> str:
        name = (
            f"points where adaptive is below no speculation beyond the noise (the paired "
            f"ratios' {INTERVAL_LEVEL:.0%} interval under 1.0)"
        )
        if not self.with_interval:
            return f"{name}: – (an interval needs 6 repeats or more)"
        below = ", ".join(self.below_none or []) or "none"
        mark = "met" if not self.below_none else "NOT met"
        return f"{name}: **{below}** of {self.with_interval} (target: none: {mark})"


def points(runs: list[dict[str, Any]]) -> list[Point]:
    """`runs`: {"workload", "arm", "concurrency", "repeat", "summary", "spec"} each."""
    keyed = [r | {"system": f"{r['workload']}/{r['arm']}"} for r in runs]
    spec: dict[tuple[str, str, int], SpecCounters] = {}
    for r in runs:
        key = (r["workload"], r["arm"], r["concurrency"])
        c = SpecCounters.from_json(r["spec"])
        spec[key] = spec[key].plus(c) if key in spec else c
    out = []
    for row in peers_report.rows(keyed):
        workload, arm = row.system.split("/")
        c = spec[(workload, arm, row.concurrency)]
        out.append(
            Point(
                workload,
                row.concurrency,
                arm,
                row.repeats,
                row.completed,
                row.failed,
                row.output_tok_s,
                row.tpot_p50_ms,
                row.ttft_p50_ms,
                mean_accepted_length=c.mean_accepted_length,
                acceptance_rate=c.acceptance_rate,
                budget_mean=c.budget_mean,
            )
        )
    by = {(p.workload, p.concurrency, p.arm): p for p in out}
    tok_s = {
        (r["workload"], r["concurrency"], r["repeat"], r["arm"]): r["summary"]["output_throughput"]
        for r in runs
    }
    for p in out:
        if (none := by.get((p.workload, p.concurrency, "none"))) is not None and p.arm != "none":
            p.vs_none = _ratio(p.output_tok_s, none.output_tok_s)
            ratios = _paired(tok_s, p, "none")
            p.vs_none_paired = statistics.median(ratios) if ratios else None
            p.vs_none_interval = median_interval(ratios)
        if p.arm == "adaptive" and (fixed := by.get((p.workload, p.concurrency, "fixed"))):
            p.vs_fixed = _ratio(p.output_tok_s, fixed.output_tok_s)
            ratios = _paired(tok_s, p, "fixed")
            p.vs_fixed_paired = statistics.median(ratios) if ratios else None
    order = {w: i for i, w in enumerate(dict.fromkeys(r["workload"] for r in runs))}
    return sorted(out, key=lambda p: (order[p.workload], p.concurrency, ARMS.index(p.arm)))


def verdict(ps: list[Point], paired: bool = False) -> Verdict:
    """Of the ratios of the medians, with (unless `paired`) the same of the paired ratios."""
    adaptive = [p for p in ps if p.arm == "adaptive"]
    fixed_of = (lambda p: p.vs_fixed_paired) if paired else (lambda p: p.vs_fixed)
    none_of = (lambda p: p.vs_none_paired) if paired else (lambda p: p.vs_none)
    vs_fixed = [v for p in adaptive if (v := fixed_of(p)) is not None]
    vs_none = [(v, f"{p.workload} c{p.concurrency}") for p in adaptive if (v := none_of(p))]
    low = min(vs_none) if vs_none else (None, None)
    edit_c1 = [none_of(p) for p in adaptive if (p.workload, p.concurrency) == ("edit", 1)]
    out = Verdict(
        sum(vs_fixed) / len(vs_fixed) if vs_fixed else None,
        low[0],
        low[1],
        edit_c1[0] if edit_c1 else None,
        None if paired else verdict(ps, paired=True),
    )
    if paired:
        intervals = [(p, p.vs_none_interval) for p in adaptive if p.vs_none_interval is not None]
        out.below_none = [f"{p.workload} c{p.concurrency}" for p, (_, hi) in intervals if hi < 1]
        out.with_interval = len(intervals)
    return out


def median_interval(xs: list[float], level: float = INTERVAL_LEVEL) -> tuple[float, float] | None:
    """[x_(k), x_(n+1-k)] of the sorted `xs`, for the largest k where that interval holds the
    median with at least `level` confidence: each x falls either side of the median with
    probability 1/2, so x_(k) lies above it with P(Binomial(n, 1/2) < k). None where even
    the whole range has less (n < 6 at 95 %)."""
    n, s = len(xs), sorted(xs)
    k, below = 0, 0.0
    for j in range(n // 2 + 1):
        below += math.comb(n, j) / 2**n  # P(Binomial(n, 1/2) <= j)
        if 2 * below > 1 - level:
            break
        k = j + 1
    return (s[k - 1], s[n - k]) if k else None


def table(ps: list[Point]) -> str:
    lines = [
        "| workload | conc. | arm | output tok/s | ÷ none | ÷ fixed 5 | ÷ none, paired | "
        f"÷ fixed 5, paired | ÷ none, paired, {INTERVAL_LEVEL:.0%} interval | TPOT p50 | "
        "TTFT p50 | mean accepted length | acceptance | draft tokens / step | "
        "completed / failed |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in ps:
        lines.append(
            f"| {p.workload} | {p.concurrency} | {ARM_NAMES.get(p.arm, p.arm)} | "
            f"{p.output_tok_s:.1f} | {_x(p.vs_none)} | {_x(p.vs_fixed)} | "
            f"{_x(p.vs_none_paired)} | {_x(p.vs_fixed_paired)} | {_span(p.vs_none_interval)} | "
            f"{_ms(p.tpot_p50_ms)} | {_ms(p.ttft_p50_ms)} | {_f(p.mean_accepted_length)} | "
            f"{_pct(p.acceptance_rate)} | {_f(p.budget_mean)} | {p.completed} / {p.failed} |"
        )
    return "\n".join(lines)


def summed(runs: list[dict[str, Any]]) -> dict[tuple[str, str], SpecCounters]:
    """Each (workload, arm)'s counters over all its runs."""
    out: dict[tuple[str, str], SpecCounters] = {}
    for r in runs:
        key = (r["workload"], r["arm"])
        c = SpecCounters.from_json(r["spec"])
        out[key] = out[key].plus(c) if key in out else c
    return out


def acceptance_table(sums: dict[tuple[str, str], SpecCounters]) -> str:
    """Per (workload, arm): of the drafts verified to position j, the fraction accepted there
    (over every concurrency and repeat), with the count verified."""
    spec = {k: c for k, c in sums.items() if c.present and c.verified}
    if not spec:
        return (
            "acceptance by position: the servers reported none (no "
            "`deepinfer:spec_decode_num_verified_tokens_per_pos` in /metrics)"
        )
    width = max(len(c.verified) for c in spec.values())
    head = " | ".join(f"pos {j + 1}" for j in range(width))
    lines = [
        f"| workload | arm | {head} |",
        "|---|---|" + "---:|" * width,
    ]
    for (workload, arm), c in spec.items():
        cells = []
        for j, rate in enumerate(c.by_position()):
            cells.append("–" if rate is None else f"{rate:.1%} ({c.verified[j]})")
        cells += ["–"] * (width - len(cells))
        lines.append(f"| {workload} | {ARM_NAMES.get(arm, arm)} | {' | '.join(cells)} |")
    return "\n".join(lines)


def calibration_table(sums: dict[tuple[str, str], SpecCounters]) -> str:
    """Per (workload, arm) and confidence bin: positions tested, the drafter's mean raw
    confidence there (raw), the calibrated acceptance the policy expected of them (expected)
    and the fraction accepted (observed)."""
    spec = {k: c for k, c in sums.items() if any(b.trials for b in c.bins)}
    if not spec:
        return "calibration: the servers reported no calibration bins in /health"
    lines = [
        "| workload | arm | confidence | tested | raw | expected | observed |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for (workload, arm), c in spec.items():
        for b in c.bins:
            if b.trials:
                lines.append(
                    f"| {workload} | {ARM_NAMES.get(arm, arm)} | [{b.lo:.2f}, {b.hi:.2f}) | "
                    f"{b.trials} | {_pct(b.expected)} | {_pct(b.calibrated)} | "
                    f"{_pct(b.observed)} |"
                )
    return "\n".join(lines)


def markdown(runs: list[dict[str, Any]]) -> str:
    ps = points(runs)
    sums = summed(runs)
    parts = [
        table(ps),
        "\n".join(f"- {line}" for line in verdict(ps).lines()),
        acceptance_table(sums),
        calibration_table(sums),
    ]
    return "\n\n".join(parts)


def plot(ps: list[Point], path: Path, title: str) -> bool:
    """Output tok/s and TPOT p50 against concurrency, a line per workload and arm."""
    rows = [
        peers_report.Row(
            f"{p.workload} / {ARM_NAMES.get(p.arm, p.arm)}",
            p.concurrency,
            p.repeats,
            p.completed,
            p.failed,
            p.output_tok_s,
            p.ttft_p50_ms,
            float("nan"),
            p.tpot_p50_ms,
            float("nan"),
        )
        for p in ps
    ]
    return peers_report.plot(rows, path, title)


def _target(name: str, value: float | None, target: float) -> str:
    if value is None:
        return f"{name}: – (target ≥ {target:.2f}×; not measured)"
    mark = "met" if value >= target else "NOT met"
    return f"{name}: **{value:.3f}×** (target ≥ {target:.2f}×: {mark})"


def _paired(tok_s: dict[tuple[str, int, int, str], float], p: Point, other: str) -> list[float]:
    """Each repeat's `p` output tok/s / `other`'s in the same repeat."""
    return [
        r
        for (w, c, rep, arm), v in tok_s.items()
        if (w, c, arm) == (p.workload, p.concurrency, p.arm)
        and (r := _ratio(v, tok_s.get((w, c, rep, other), float("nan")))) is not None
    ]


def _ratio(a: float, b: float) -> float | None:
    return a / b if b and a == a and b == b else None  # x == x: not NaN


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}×"


def _span(v: tuple[float, float] | None) -> str:
    return "–" if v is None else f"{v[0]:.2f}–{v[1]:.2f}×"


def _f(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}"


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v:.1%}"


def _ms(v: float | None) -> str:
    return "–" if v is None or v != v else f"{v:.0f} ms" if v >= 10 else f"{v:.1f} ms"

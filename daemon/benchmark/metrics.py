"""Summary of a serving run: throughput, latency percentiles, goodput under SLOs, cache hits."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from daemon.benchmark.client import RequestRecord

PERCENTILES = (50, 90, 99)


@dataclass
class Latency:
    """Milliseconds."""

    mean: float = math.nan
    median: float = math.nan
    p90: float = math.nan
    p99: float = math.nan
    count: int = 0

    @staticmethod
    def of(seconds: list[float]) -> Latency:
        if not seconds:
            return Latency()
        ms = sorted(s * 1000 for s in seconds)
        return Latency(
            sum(ms) / len(ms),
            percentile(ms, 50),
            percentile(ms, 90),
            percentile(ms, 99),
            len(ms),
        )


def percentile(ordered: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default) of sorted values."""
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass
class Summary:
    completed: int
    failed: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    requested_output_tokens: int  # max_tokens of the completed requests
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: Latency
    tpot_ms: Latency
    itl_ms: Latency
    e2el_ms: Latency
    max_concurrency_seen: int
    slos_ms: dict[str, float] = field(default_factory=dict)
    good_requests: int | None = None
    goodput: float | None = None  # requests meeting every SLO, per second
    cached_tokens: int | None = None  # where usage reported prompt_tokens_details.cached_tokens
    prefix_cache_hit_rate: float | None = None  # of the prompt tokens of those requests
    errors: dict[str, int] = field(default_factory=dict)  # message (first 120 chars) -> count


def summarize(
    records: list[RequestRecord], duration_s: float, slos_ms: dict[str, float] | None = None
) -> Summary:
    ok = [r for r in records if r.ok]
    duration_s = max(duration_s, 1e-9)
    inp = sum(r.prompt_tokens for r in ok)
    out = sum(r.output_tokens for r in ok)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [t for r in ok if (t := r.tpot_s) is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    itl = [g for r in ok for g in r.itl_s]
    s = Summary(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        input_tokens=inp,
        output_tokens=out,
        requested_output_tokens=sum(r.max_tokens for r in ok),
        request_throughput=len(ok) / duration_s,
        input_throughput=inp / duration_s,
        output_throughput=out / duration_s,
        total_token_throughput=(inp + out) / duration_s,
        ttft_ms=Latency.of(ttft),
        tpot_ms=Latency.of(tpot),
        itl_ms=Latency.of(itl),
        e2el_ms=Latency.of(e2e),
        max_concurrency_seen=_max_concurrency(records),
    )
    if slos_ms:
        s.slos_ms = dict(slos_ms)
        s.good_requests = sum(_meets(r, slos_ms) for r in ok)
        s.goodput = s.good_requests / duration_s
    reported = [r for r in ok if r.cached_tokens is not None]
    if reported:
        s.cached_tokens = sum(r.cached_tokens or 0 for r in reported)
        prompt = sum(r.prompt_tokens for r in reported)
        s.prefix_cache_hit_rate = s.cached_tokens / prompt if prompt else 0.0
    for r in records:
        if not r.ok:
            key = (r.error or "unknown")[:120]
            s.errors[key] = s.errors.get(key, 0) + 1
    return s


def _meets(r: RequestRecord, slos_ms: dict[str, float]) -> bool:
    values = {
        "ttft": r.ttft_s,
        "tpot": r.tpot_s if r.tpot_s is not None else 0.0,  # one-token answers: no TPOT
        "e2el": r.e2e_s,
    }
    return all(values[k] is not None and values[k] * 1000 <= bound for k, bound in slos_ms.items())


def _max_concurrency(records: list[RequestRecord]) -> int:
    events: list[tuple[float, int]] = []
    for r in records:
        if r.e2e_s is not None:
            events += [(r.start_s, 1), (r.start_s + r.e2e_s, -1)]
    live = peak = 0
    for _, d in sorted(events, key=lambda e: (e[0], e[1])):
        live += d
        peak = max(peak, live)
    return peak


def report(s: Summary, label: str | None = None) -> str:
    """vLLM-style text block."""
    title = f" Serving Benchmark Result{f' ({label})' if label else ''} "
    lines = [f"{title:=^60}"]

    def row(name: str, value: object, fmt: str = "") -> None:
        lines.append(f"{name:<44}{format(value, fmt):>16}")

    row("Successful requests:", s.completed)
    row("Failed requests:", s.failed)
    row("Maximum concurrency seen:", s.max_concurrency_seen)
    row("Benchmark duration (s):", s.duration_s, ".2f")
    row("Total input tokens:", s.input_tokens)
    row("Total generated tokens:", s.output_tokens)
    row("Requested output tokens (max_tokens):", s.requested_output_tokens)
    row("Request throughput (req/s):", s.request_throughput, ".2f")
    if s.goodput is not None:
        row("Request goodput (req/s):", s.goodput, ".2f")
        row(f"Requests meeting {_slo_text(s.slos_ms)}:", s.good_requests)
    row("Output token throughput (tok/s):", s.output_throughput, ".2f")
    row("Input token throughput (tok/s):", s.input_throughput, ".2f")
    row("Total token throughput (tok/s):", s.total_token_throughput, ".2f")
    if s.prefix_cache_hit_rate is not None:
        row("Prefix cache hit rate (cached/prompt):", f"{s.prefix_cache_hit_rate:.2%}")
    for name, lat in (
        ("Time to First Token", s.ttft_ms),
        ("Time per Output Token (excl. 1st token)", s.tpot_ms),
        ("Inter-token Latency", s.itl_ms),
        ("End-to-end Latency", s.e2el_ms),
    ):
        lines.append(f"{' ' + name + ' ':-^60}")
        short = name.split(" (")[0]
        abbrev = {"Time to First Token": "TTFT", "Time per Output Token": "TPOT"}.get(
            short, "ITL" if short.startswith("Inter") else "E2EL"
        )
        row(f"Mean {abbrev} (ms):", lat.mean, ".2f")
        row(f"Median {abbrev} (ms):", lat.median, ".2f")
        row(f"P90 {abbrev} (ms):", lat.p90, ".2f")
        row(f"P99 {abbrev} (ms):", lat.p99, ".2f")
    if s.errors:
        lines.append(f"{' Errors ':-^60}")
        lines += [f"{n:>6} x {msg}" for msg, n in sorted(s.errors.items(), key=lambda e: -e[1])]
    lines.append("=" * 60)
    return "\n".join(lines)


def _slo_text(slos: dict[str, float]) -> str:
    return ", ".join(f"{k}<={v:g}ms" for k, v in slos.items())

"""The server's speculative-decoding counters around a run, read before and after it, and their
difference: /metrics (drafts, accepted tokens by position, the chosen budget: vLLM's
`spec_decode` counters) and, where /health carries them, the calibration bins. A server without
them gives empty counters."""

from __future__ import annotations

import json
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any

from daemon.loop.spec.calibration import CalibrationBin as Bin

# /metrics counters (daemon/loop/metrics.py), all counts since start
PREFIX = "deepinfer:spec_decode_"
TOTALS = {
    "drafts": "num_drafts",
    "draft_tokens": "num_draft_tokens",
    "accepted_tokens": "num_accepted_tokens",
    "steps": "budget_steps",
    "budget_tokens": "budget_tokens",
}
BY_POSITION = {"verified": "num_verified_tokens_per_pos", "accepted": "num_accepted_tokens_per_pos"}
BIN_FIELDS = ("trials", "accepted", "confidence_sum", "calibrated_sum")
REQUIRED_BIN_FIELDS = ("lo", "hi", "trials", "accepted", "confidence_sum")


@dataclass
class SpecCounters:
    """Counts of a span of the server's life (a run: after minus before)."""

    present: bool = False  # the server reports speculative decoding at all
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    steps: int = 0
    budget_tokens: int = 0
    verified: list[int] = field(default_factory=list)  # per draft position
    accepted: list[int] = field(default_factory=list)
    bins: list[Bin] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)  # every `spec` counter sample
    # the adaptive policy's online step-cost corrections at the span's end (/health)
    costs: list[dict[str, float]] = field(default_factory=list)

    @staticmethod
    def of(metrics: dict[str, float], health: dict[str, Any]) -> SpecCounters:
        """From /metrics counter samples (`spec_samples`) and the /health body."""
        total = {name: v for name, v in metrics.items() if name.startswith(PREFIX)}
        c = SpecCounters(present=f"{PREFIX}{TOTALS['drafts']}_total" in total, metrics=metrics)
        for attr, name in TOTALS.items():
            setattr(c, attr, int(total.get(f"{PREFIX}{name}_total", 0)))
        c.verified = _by_position(total, BY_POSITION["verified"])
        c.accepted = _by_position(total, BY_POSITION["accepted"])
        c.bins = _bins(health)
        corrections = health.get("spec_cost_corrections")
        c.costs = list(corrections) if isinstance(corrections, list) else []
        return c

    def minus(self, before: SpecCounters) -> SpecCounters:
        out = SpecCounters(present=self.present)
        for attr in TOTALS:
            setattr(out, attr, getattr(self, attr) - getattr(before, attr))
        out.verified = _sub(self.verified, before.verified)
        out.accepted = _sub(self.accepted, before.accepted)
        old = {(b.lo, b.hi): b for b in before.bins}
        for b in self.bins:
            o = old.get((b.lo, b.hi), Bin(b.lo, b.hi))
            out.bins.append(Bin(b.lo, b.hi, *(getattr(b, f) - getattr(o, f) for f in BIN_FIELDS)))
        out.metrics = {k: v - before.metrics.get(k, 0.0) for k, v in self.metrics.items()}
        out.costs = self.costs
        return out

    def plus(self, other: SpecCounters) -> SpecCounters:
        """Two spans together (repeats, concurrencies)."""
        out = SpecCounters(present=self.present or other.present)
        for attr in TOTALS:
            setattr(out, attr, getattr(self, attr) + getattr(other, attr))
        out.verified = _add(self.verified, other.verified)
        out.accepted = _add(self.accepted, other.accepted)
        bins = {
            (b.lo, b.hi): Bin(b.lo, b.hi, *(getattr(b, f) for f in BIN_FIELDS)) for b in self.bins
        }
        for b in other.bins:
            mine = bins.setdefault((b.lo, b.hi), Bin(b.lo, b.hi))
            for f in BIN_FIELDS:
                setattr(mine, f, getattr(mine, f) + getattr(b, f))
        out.bins = sorted(bins.values(), key=lambda b: b.lo)
        out.metrics = {
            k: self.metrics.get(k, 0.0) + other.metrics.get(k, 0.0)
            for k in self.metrics.keys() | other.metrics.keys()
        }
        out.costs = other.costs or self.costs
        return out

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verifying request gets per step: its accepted drafts and one more."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def budget_mean(self) -> float | None:
        """Draft tokens chosen per step that verified any."""
        return self.budget_tokens / self.steps if self.steps else None

    def by_position(self) -> list[float | None]:
        """Per position j: of the drafts verified that far, the fraction accepted there."""
        return [a / v if v else None for a, v in zip(self.accepted, self.verified, strict=False)]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["bins"] = [b.as_dict() for b in self.bins]
        d |= {
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_rate": self.acceptance_rate,
            "budget_mean": self.budget_mean,
            "acceptance_by_position": self.by_position(),
        }
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> SpecCounters:
        c = SpecCounters(present=d["present"], metrics=dict(d.get("metrics") or {}))
        for attr in TOTALS:
            setattr(c, attr, d[attr])
        c.verified, c.accepted = list(d["verified"]), list(d["accepted"])
        c.costs = list(d.get("costs") or [])
        c.bins = [Bin(b["lo"], b["hi"], *(b.get(f, 0) for f in BIN_FIELDS)) for b in d["bins"]]
        return c


def read(base_url: str, timeout_s: float = 10.0) -> SpecCounters:
    """The server's counters now (empty where it has none)."""
    with urllib.request.urlopen(base_url + "/health", timeout=timeout_s) as r:
        health = json.loads(r.read())
    with urllib.request.urlopen(base_url + "/metrics", timeout=timeout_s) as r:
        metrics = spec_samples(r.read().decode())
    return SpecCounters.of(metrics, health)


def spec_samples(text: str) -> dict[str, float]:
    """The samples of every /metrics counter named with `spec`, keyed name{labels}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if "spec" not in family.name or family.type != "counter":
            continue
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


def _bins(health: dict[str, Any]) -> list[Bin]:
    """The calibration table, where /health carries one: a list of bins under a key naming
    calibration, each with lo, hi, trials, accepted, confidence_sum (and calibrated_sum, the
    policy's expectation: 0 where a server does not report it)."""
    for key, value in health.items():
        if "calibration" not in key or not isinstance(value, list):
            continue
        bins = [
            Bin(
                float(b["lo"]),
                float(b["hi"]),
                int(b["trials"]),
                int(b["accepted"]),
                float(b["confidence_sum"]),
                float(b.get("calibrated_sum", 0.0)),
            )
            for b in value
            if isinstance(b, dict) and all(k in b for k in REQUIRED_BIN_FIELDS)
        ]
        if bins:
            return bins
    return []


def _by_position(total: dict[str, float], name: str) -> list[int]:
    """A per-position counter's values, position 0 first."""
    head = f'{PREFIX}{name}_total{{position="'
    at = {int(k[len(head) : -2]): int(v) for k, v in total.items() if k.startswith(head)}
    return [at.get(j, 0) for j in range(max(at) + 1)] if at else []


def _sub(a: list[int], b: list[int]) -> list[int]:
    return [x - (b[i] if i < len(b) else 0) for i, x in enumerate(a)]


def _add(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]

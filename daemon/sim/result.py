"""A simulation's figures: throughput, TTFT and TPOT percentiles, prefix hit rate by tier,
host and block-store bytes, and the cluster's queues over time, as one JSON-ready dict."""

from __future__ import annotations

import statistics
from dataclasses import asdict

from daemon.kv.tier_stats import TIERS
from daemon.sim.cluster import RequestRecord, SimRun
from daemon.sim.node import SimNode

PERCENTILES = (50, 90, 99)


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in PERCENTILES} | {"mean": None}
    ordered = sorted(values)
    out: dict[str, float | None] = {}
    for p in PERCENTILES:  # nearest rank
        out[f"p{p}"] = ordered[min(len(ordered) - 1, max(0, -(-p * len(ordered) // 100) - 1))]
    return out | {"mean": statistics.fmean(ordered)}


def summarize(run: SimRun) -> dict:
    done = [r for r in run.records if r.finish_s is not None]
    ttft = [r.first_token_s - r.arrival_s for r in done if r.first_token_s is not None]
    tpot = [
        (r.finish_s - r.first_token_s) / (r.output_length - 1)
        for r in done
        if r.first_token_s is not None and r.output_length > 1
    ]
    span = max(run.end_s - min((r.arrival_s for r in run.records), default=0.0), 1e-9)
    prompt = sum(r.input_length for r in done)
    by_tier = {t: sum(r.cached_by_tier.get(t, 0) for r in done) for t in TIERS}
    out_tokens = sum(r.output_length for r in done)
    nodes = run.nodes
    store = run.store
    return {
        "config": {
            "nodes": run.cfg.nodes,
            "prefill": run.cfg.prefill,
            "decode": run.cfg.decode,
            "link": asdict(run.cfg.link),
            "policy": run.cfg.policy,
            "time_scale": run.cfg.time_scale,
            "max_concurrency": run.cfg.max_concurrency,
            "request_s": run.cfg.request_s,
            "overlap": run.cfg.overlap,
            "store_bytes": _finite(run.cfg.store_bytes),
            "node": {k: _finite(v) for k, v in asdict(run.cfg.node).items()},
        },
        "requests": len(run.records),
        "finished": len(done),
        "rejected": sum(r.rejected for r in run.records),
        "simulated_s": run.end_s,
        "wall_s": run.wall_s,
        "throughput": {
            "output_tok_s": out_tokens / span,
            "input_tok_s": prompt / span,
            "requests_s": len(done) / span,
        },
        "ttft_s": percentiles(ttft),
        "tpot_s": percentiles(tpot),
        "prefix": {
            "prompt_tokens": prompt,
            "hit_tokens": sum(by_tier.values()),
            "hit_rate": sum(by_tier.values()) / prompt if prompt else 0.0,
            "hit_rate_by_tier": {t: by_tier[t] / prompt if prompt else 0.0 for t in TIERS},
            "hit_tokens_by_tier": by_tier,
        },
        "host_bytes": {
            "saved": sum(n.counters.host_bytes_saved for n in nodes),
            "loaded": sum(n.counters.host_bytes_loaded for n in nodes),
        },
        "store_bytes": {
            "written": store.counters.bytes_written if store else 0,
            "read": store.counters.bytes_read if store else 0,
        },
        "handoff": _handoffs(done, run.records),
        "moe": _moe(nodes),
        "spec": _spec(nodes),
        "per_node": [
            {"role": n.role} | asdict(n.counters) | {"utilization": n.counters.busy_s / span}
            for n in nodes
        ],
        "timeline": [asdict(s) for s in run.samples],
    }


def _handoffs(done: list[RequestRecord], records: list[RequestRecord]) -> dict:
    """Prefill / decode pairs' KV handoffs: how many, their bytes, the time from a request's
    arrival to its KV on the decode node; and the TTFT in parts (`ttft_parts`) of every request
    with a first token, finished or not (a run stopped early: those that made it miss)."""
    handed = [r for r in done if r.handoff_s is not None]
    return {
        "count": len(handed),
        "bytes": sum(r.handoff_bytes for r in handed),
        "arrival_to_kv_s": percentiles([r.handoff_s - r.arrival_s for r in handed]),  # type: ignore[operator]
        "ttft_parts_s": ttft_parts(records),
    }


def ttft_parts(records: list[RequestRecord]) -> dict[str, dict[str, float | None]]:
    """A pair's TTFT, phase by phase: waiting for the decode node to reserve the prompt's
    blocks, the prefill (its queue and compute), the handoff (export, link, import), and the
    decode node's first token (admission and the last prompt token)."""
    whole = [
        r
        for r in records
        if None not in (r.reserved_s, r.prefilled_s, r.handoff_s, r.first_token_s)
    ]
    edges = ("arrival_s", "reserved_s", "prefilled_s", "handoff_s", "first_token_s")
    names = ("decode_kv_wait", "prefill", "handoff", "first_token")
    return {
        name: percentiles([getattr(r, b) - getattr(r, a) for r in whole])
        for name, a, b in zip(names, edges[:-1], edges[1:], strict=True)
    }


def _moe(nodes: list[SimNode]) -> dict | None:
    """MoE nodes' expert placement (None for a dense model): rebalances, slots moved, the
    seconds the imbalance added, and the mean step imbalance before and after the first
    rebalance (over the nodes' steps), in all and per node."""
    per_node = [n.experts.summary() for n in nodes if n.experts is not None]
    if not per_node:
        return None
    out: dict = {k: sum(s[k] for s in per_node) for k in ("rebalances", "moved_slots")}
    out["stretch_s"] = sum(s["stretch_s"] for s in per_node)
    for half in ("before", "after"):
        steps = sum(s[f"steps_{half}"] for s in per_node)
        total = sum(s[f"imbalance_sum_{half}"] for s in per_node)
        out[f"step_imbalance_{half}_first_rebalance"] = total / steps if steps else None
    return out | {"per_node": per_node}


def _spec(nodes: list[SimNode]) -> dict | None:
    """Speculating nodes' drafts verified and accepted (None without speculation), in all
    and per node (the Speculator's own report)."""
    specs = [n.spec.speculator for n in nodes if n.spec is not None]
    if not specs:
        return None
    return {
        "draft_tokens": sum(s.stats.num_draft_tokens for s in specs),
        "accepted_tokens": sum(s.stats.num_accepted_tokens for s in specs),
        "steps": sum(s.stats.num_steps for s in specs),
        "per_node": [s.as_dict() for s in specs],
    }


def _finite(x: float) -> float | str:
    return "unlimited" if x == float("inf") else x

"""Sizing: the cheapest cluster that meets TTFT and TPOT p99 SLOs on a trace, found by
simulating candidates (each run stopped as soon as it is sure to miss the TTFT SLO).

The search, for each host-memory option: unified clusters by binary search on the node count;
prefill / decode clusters by binary search on the total, each total's split by binary search
on the prefill nodes, the fewest whose TTFT p99 meets the SLO (the rest decode: the best TPOT
that total allows). Both searches assume that more nodes (of a role) never make things worse.
A cluster costs nodes x (1 + host GB per node x `host_gb_cost`), in nodes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tqdm import tqdm

from daemon.sim.cluster import SLO, ClusterConfig, Simulation
from daemon.sim.result import summarize
from daemon.sim.table import CostTable
from daemon.sim.trace import TraceRequest

GIB = 2**30
MODES = ("unified", "pairs")


def size(
    table: CostTable,
    trace: list[TraceRequest],
    base: ClusterConfig,
    slo: SLO,
    max_nodes: int,
    host_bytes: list[float],
    host_gb_cost: float = 0.0,
    modes: tuple[str, ...] = MODES,
    progress: bool = True,
) -> dict:
    trials: dict[tuple[int, int, int, float], dict] = {}
    bar = tqdm(desc="sizing", unit="run", disable=not progress)

    def trial(unified: int, prefill: int, decode: int, host: float) -> dict:
        key = (unified, prefill, decode, host)
        if key not in trials:
            node = dataclasses.replace(base.node, host_bytes=host)
            cfg = dataclasses.replace(
                base, nodes=unified, prefill=prefill, decode=decode, node=node
            )
            sim = Simulation(table, trace, cfg, slo=SLO(slo.ttft_p99_s, float("inf")))
            sim.run()
            s = summarize(sim.result())
            ttft, tpot = s["ttft_s"]["p99"], s["tpot_s"]["p99"]
            whole = sim.missed is None and s["finished"] == len(trace)
            ttft_ok = whole and ttft is not None and ttft <= slo.ttft_p99_s
            tpot_ok = whole and (tpot is None or tpot <= slo.tpot_p99_s)
            trials[key] = {
                "unified": unified,
                "prefill": prefill,
                "decode": decode,
                "host_gb_per_node": _gb(host),
                "cost": (unified + prefill + decode) * (1 + host / GIB * host_gb_cost),
                "ttft_p99_s": ttft,
                "tpot_p99_s": tpot,
                "finished": s["finished"],
                "stopped_early": sim.missed is not None,
                "hit_rate": s["prefix"]["hit_rate"],
                "ttft_ok": ttft_ok,
                "meets": ttft_ok and tpot_ok,
                "wall_s": s["wall_s"],
            }
            bar.update()
        return trials[key]

    def meets(unified: int, prefill: int, decode: int, host: float) -> bool:
        return trial(unified, prefill, decode, host)["meets"]

    def split(total: int, host: float) -> int | None:
        """The fewest prefill nodes of `total` that meet the TTFT SLO, if that split meets
        the TPOT SLO too."""
        p = smallest(1, total - 1, lambda p: trial(0, p, total - p, host)["ttft_ok"])
        return p if p is not None and meets(0, p, total - p, host) else None

    best: dict[str, dict | None] = {}
    try:
        for host in host_bytes:
            if "unified" in modes:
                n = smallest(1, max_nodes, lambda n, h=host: meets(n, 0, 0, h))
                _keep(best, "unified", trial(n, 0, 0, host) if n is not None else None)
            if "pairs" in modes and max_nodes >= 2:
                total = smallest(2, max_nodes, lambda t, h=host: split(t, h) is not None)
                p = split(total, host) if total is not None else None
                found = trial(0, p, total - p, host) if total is not None and p else None
                _keep(best, "pairs", found)
    finally:
        bar.close()
    found = [b for b in best.values() if b is not None]
    return {
        "slo": dataclasses.asdict(slo),
        "max_nodes": max_nodes,
        "host_gb_cost": host_gb_cost,
        "best": best,
        "cheapest": min(found, key=lambda b: b["cost"]) if found else None,
        "trials": list(trials.values()),
    }


def smallest(lo: int, hi: int, ok: Callable[[int], bool]) -> int | None:
    """The smallest n in [lo, hi] with ok(n), by bisection (ok assumed monotone); None when
    not even ok(hi)."""
    if lo > hi or not ok(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _keep(best: dict[str, dict | None], mode: str, found: dict | None) -> None:
    old = best.get(mode)
    if found is not None and (old is None or found["cost"] < old["cost"]):
        best[mode] = found
    elif mode not in best:
        best[mode] = None


def _gb(x: float) -> float | str:
    return "unlimited" if x == float("inf") else x / GIB

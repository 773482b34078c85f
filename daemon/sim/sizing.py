"""Sizing: the cheapest cluster that meets TTFT and TPOT p99 SLOs on a trace, found by
simulating candidates (each run stopped as soon as it is sure to miss an SLO).

For each host-memory option: unified clusters by binary search on the node count (more
nodes assumed never worse); prefill / decode clusters by `cheapest_split`, which bisects each
total's split by the role a missing split is short of (`short_side`, from where its requests
waited). A cluster costs nodes x (1 + host GB per node x `host_gb_cost`), in nodes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

from tqdm import tqdm

from daemon.sim.cluster import SLO, ClusterConfig, RequestRecord, Simulation
from daemon.sim.result import summarize
from daemon.sim.table import CostTable
from daemon.sim.trace import TraceRequest

GIB = 2**30
MODES = ("unified", "pairs")
Side = Literal["prefill", "decode"]


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
            sim = Simulation(table, trace, cfg, slo=slo)
            sim.run()
            s = summarize(sim.result())
            ttft, tpot = s["ttft_s"]["p99"], s["tpot_s"]["p99"]
            whole = sim.missed is None and s["finished"] == len(trace)
            parts = s["handoff"]["ttft_parts_s"] if prefill else {}
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
                "missed": sim.missed,  # the SLO a run stopped early was sure to miss
                "hit_rate": s["prefix"]["hit_rate"],
                "meets": whole
                and ttft is not None
                and ttft <= slo.ttft_p99_s
                and (tpot is None or tpot <= slo.tpot_p99_s),
                "ttft_parts_p99_s": {k: v["p99"] for k, v in parts.items()},
                "short_of": None,
                "wall_s": s["wall_s"],
            }
            if prefill and not trials[key]["meets"]:
                ttft_met = ttft is not None and ttft <= slo.ttft_p99_s
                missed = sim.missed or ("tpot" if whole and ttft_met else "ttft")
                trials[key]["short_of"] = short_side(sim.records, slo.ttft_p99_s, sim.now, missed)
            bar.update()
        return trials[key]

    def meets(unified: int, prefill: int, decode: int, host: float) -> bool:
        return trial(unified, prefill, decode, host)["meets"]

    best: dict[str, dict | None] = {}
    try:
        for host in host_bytes:
            if "unified" in modes:
                n = smallest(1, max_nodes, lambda n, h=host: meets(n, 0, 0, h))
                _keep(best, "unified", trial(n, 0, 0, host) if n is not None else None)
            if "pairs" in modes and max_nodes >= 2:
                pd = cheapest_split(max_nodes, lambda p, d, h=host: trial(0, p, d, h)["short_of"])
                _keep(best, "pairs", trial(0, *pd, host) | {"pd_ratio": ratio(*pd)} if pd else None)
    finally:
        bar.close()
    found = [b for b in best.values() if b is not None]
    return {
        "slo": dataclasses.asdict(slo),
        "max_nodes": max_nodes,
        "host_gb_cost": host_gb_cost,
        "best": best,
        "cheapest": min(found, key=lambda b: b["cost"]) if found else None,
        "pd_ratio": best["pairs"]["pd_ratio"] if best.get("pairs") else None,
        "trials": list(trials.values()),
    }


def cheapest_split(
    max_nodes: int, probe: Callable[[int, int], Side | None]
) -> tuple[int, int] | None:
    """The (prefill, decode) counts of the fewest nodes, at most `max_nodes`, that meet the
    SLOs; None if no split found does. `probe(p, d)`: None if that split meets, else the role
    it is short of. Totals by bisection (a cluster a node larger is assumed to have a split as
    good); each total's split by bisection on the prefill count, directed by the role a
    missing split is short of, not by TTFT alone (which is not monotone in the prefill count:
    fewer decode nodes make prompts wait for decode KV room)."""
    found: dict[int, int | None] = {}

    def at(total: int) -> int | None:
        if total not in found:
            lo, hi, found[total] = 1, total - 1, None
            while lo <= hi:
                p = (lo + hi) // 2
                short = probe(p, total - p)
                if short is None:
                    found[total] = p
                    break
                lo, hi = (p + 1, hi) if short == "prefill" else (lo, p - 1)
        return found[total]

    total = smallest(2, max_nodes, lambda t: at(t) is not None)
    if total is None:
        return None
    p = at(total)
    assert p is not None
    return p, total - p


def short_side(records: list[RequestRecord], ttft_s: float, now: float, missed: str) -> Side:
    """The role a pair cluster that missed its SLOs is short of: decode for a TPOT miss; for
    TTFT, the side where its late requests (TTFT over `ttft_s`; with none, all) spent more of
    their time to the first token: decode (waiting for KV room, then the first token there)
    or prefill (its queue and compute, then the handoff from that node). Only requests with a
    first token count, where there are any: the decode KV that others wait for may be held by
    prompts still queued for prefill (a decode node reserves a prompt's blocks first)."""
    if missed == "tpot":
        return "decode"
    paired = [r for r in records if r.prefill_node is not None]
    timed = [r for r in paired if r.first_token_s is not None and r.handoff_s is not None]
    late = [r for r in timed if r.first_token_s - r.arrival_s > ttft_s]  # type: ignore[operator]
    sides = {"prefill": 0.0, "decode": 0.0}
    for r in late or timed or paired:
        end = r.first_token_s if r.first_token_s is not None else now
        marks = (r.reserved_s, r.prefilled_s, r.handoff_s)
        t = [r.arrival_s, *(end if x is None else x for x in marks), end]
        sides["decode"] += (t[1] - t[0]) + (t[4] - t[3])
        sides["prefill"] += (t[2] - t[1]) + (t[3] - t[2])
    return "decode" if sides["decode"] > sides["prefill"] else "prefill"


def ratio(prefill: int, decode: int) -> str:
    """P:D as counts and per prefill node, e.g. "6:14 (1:2.33)"."""
    return f"{prefill}:{decode} (1:{decode / prefill:.2f})"


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

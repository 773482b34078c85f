"""Hit rate against capacity: one trace simulated over a grid of host-memory (per node) and
block-store capacities, each point a whole run; the curve as a JSON-ready dict."""

from __future__ import annotations

import dataclasses

from tqdm import tqdm

from daemon.sim.cluster import ClusterConfig, simulate
from daemon.sim.result import summarize
from daemon.sim.table import CostTable
from daemon.sim.trace import TraceRequest

GIB = 2**30


def sweep(
    table: CostTable,
    trace: list[TraceRequest],
    cfg: ClusterConfig,
    host_bytes: list[float],
    store_bytes: list[float],
    progress: bool = True,
) -> dict:
    """For each store capacity, each host capacity (0: no tier; inf: unlimited): the prefix
    hit rate (and by tier), TTFT, and the store's traffic; everything else as in `cfg`."""
    points = []
    grid = [(s, h) for s in store_bytes for h in host_bytes]
    for store, host in tqdm(grid, desc="capacities", unit="run", disable=not progress):
        node = dataclasses.replace(cfg.node, host_bytes=host)
        run = simulate(table, trace, dataclasses.replace(cfg, node=node, store_bytes=store), False)
        s = summarize(run)
        points.append(
            {
                "host_gb_per_node": _gb(host),
                "store_gb": _gb(store),
                "hit_rate": s["prefix"]["hit_rate"],
                "hit_rate_by_tier": s["prefix"]["hit_rate_by_tier"],
                "ttft_s": s["ttft_s"],
                "tpot_s": s["tpot_s"],
                "finished": s["finished"],
                "rejected": s["rejected"],
                "store_bytes": s["store_bytes"],
                "wall_s": run.wall_s,
            }
        )
    return {
        "host_gb_per_node": [_gb(h) for h in host_bytes],
        "store_gb": [_gb(s) for s in store_bytes],
        "device_kv_gb_per_node": _gb(cfg.node.device_kv_bytes),
        "nodes": {"unified": cfg.nodes, "prefill": cfg.prefill, "decode": cfg.decode},
        "points": points,
    }


def _gb(x: float) -> float | str:
    return "unlimited" if x == float("inf") else x / GIB

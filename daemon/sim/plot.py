"""PNG plots of a simulation: queues over time, TTFT / TPOT distributions, hit rate by tier."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from daemon.kv.tier_stats import TIERS  # noqa: E402
from daemon.sim.cluster import SimRun  # noqa: E402


def plot(run: SimRun, summary: dict, path: str | Path) -> None:
    done = [r for r in run.records if r.finish_s is not None and r.first_token_s is not None]
    fig, ((queues, ttft), (tpot, tiers)) = plt.subplots(2, 2, figsize=(12, 8))
    t = [s.time_s for s in run.samples]
    queues.plot(t, [s.running for s in run.samples], label="running")
    queues.plot(t, [s.waiting for s in run.samples], label="waiting")
    queues.plot(t, [s.loading for s in run.samples], label="reading the store")
    queues.set(title=f"requests over time ({run.cfg.total_nodes} nodes)", xlabel="simulated s")
    queues.legend()
    for ax, values, name in (
        (ttft, [r.first_token_s - r.arrival_s for r in done], "TTFT"),
        (
            tpot,
            [
                (r.finish_s - r.first_token_s) / (r.output_length - 1)
                for r in done
                if r.output_length > 1
            ],
            "TPOT",
        ),
    ):
        ordered = sorted(values)
        ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))])
        ax.set(title=f"{name} CDF", xlabel="s", ylabel="share of requests")
        if ordered and ordered[0] > 0:
            ax.set_xscale("log")
    rates = summary["prefix"]["hit_rate_by_tier"]
    tiers.bar(list(TIERS), [100 * rates[k] for k in TIERS])
    tiers.set(
        title=f"prompt tokens hit by tier (total {100 * summary['prefix']['hit_rate']:.1f} %)",
        ylabel="%",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sweep(result: dict, path: str | Path) -> None:
    """Hit rate against host memory per node, a line per store capacity."""
    hosts = result["host_gb_per_node"]
    fig, ax = plt.subplots(figsize=(8, 5))
    for store in result["store_gb"]:
        points = [p for p in result["points"] if p["store_gb"] == store]
        rates = [100 * p["hit_rate"] for p in points]
        label = (
            "no store" if store == 0 else f"store {store}" + ("" if store == "unlimited" else " GB")
        )
        ax.plot(range(len(points)), rates, marker="o", label=label)
    ax.set_xticks(range(len(hosts)), [str(h) for h in hosts])
    ax.set(
        title=f"prefix hit rate vs capacity (device KV {result['device_kv_gb_per_node']:g} GB a node)",
        xlabel="host memory per node (GB)",
        ylabel="prompt tokens hit (%)",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

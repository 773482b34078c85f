"""A router's window of autoscaling inputs, read from what it already has: its proxied
streams' latencies (SloWindow) and the nodes' heartbeats in its PeerSet (free KV, queues)."""

from __future__ import annotations

from typing import Literal, cast

from daemon.cluster.autoscale import NodeLoad, WindowInputs, queued
from daemon.cluster.peers import PeerSet
from daemon.cluster.slo_window import SloWindow


def window_inputs(peers: PeerSet, slo: SloWindow, now: float) -> WindowInputs:
    """Nodes that drain (a role change under way) are left out of the counts."""
    ttft, tpot, samples = slo.read(now)
    nodes = [
        n
        for role in ("prefill", "decode")
        for n in peers.live(cast(Literal["prefill", "decode"], role))
        if not n.load.get("draining")
    ]
    decode = [n for n in nodes if n.role == "decode"]
    blocks = sum(n.capacity.get("kv_blocks", 0) for n in decode)
    free = sum(n.load.get("kv_blocks_free", 0) for n in decode)
    loads = tuple(
        NodeLoad(
            n.node_id,
            cast(Literal["prefill", "decode"], n.role),
            n.load.get("running", 0),
            n.load.get("waiting", 0),
        )
        for n in nodes
    )
    return WindowInputs(
        now=now,
        ttft_p99_s=ttft,
        tpot_p99_s=tpot,
        decode_kv_util=1 - free / blocks if blocks else None,
        prefill_queue=queued(loads, "prefill"),
        decode_queue=queued(loads, "decode"),
        nodes=loads,
        samples=samples,
    )

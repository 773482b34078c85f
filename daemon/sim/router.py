"""Which node a request goes to. Unified nodes: the least loaded, or the one holding the longest
prefix of it in memory among those not much busier. Prefill / decode pairs: the daemon's own
router (daemon/cluster/router.py) over the simulated nodes as peers."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

from daemon.cluster.node import NodeInfo
from daemon.cluster.peers import PeerSet
from daemon.cluster.router import PrefillBalance, Router

POLICIES = ("least-loaded", "prefix-affinity")
MODEL = FINGERPRINT = "sim"  # every simulated node serves one model


class RoutedNode(Protocol):
    node_id: str

    def load(self) -> int: ...
    def cached_prefix(self, keys: list[bytes]) -> int: ...
    def info(self) -> NodeInfo: ...


def route(policy: str, nodes: Sequence[RoutedNode], keys: list[bytes], slack: float = 2.0) -> int:
    """The node's index in `nodes`. prefix-affinity: among nodes whose load is at most `slack`
    times the least (plus one), the longest in-memory prefix of `keys`; ties go to the less
    loaded."""
    loads = [n.load() for n in nodes]
    if policy == "least-loaded" or len(nodes) == 1:
        return min(range(len(nodes)), key=lambda i: loads[i])
    if policy != "prefix-affinity":
        raise ValueError(f"unknown routing policy {policy!r}; use one of {POLICIES}")
    bound = slack * min(loads) + 1
    candidates = [i for i in range(len(nodes)) if loads[i] <= bound]
    return max(candidates, key=lambda i: (nodes[i].cached_prefix(keys), -loads[i], -i))


class PairRouter:
    """The real Router's choice of a decode node (free KV, running) and of a prefill node
    (the longest prefix it was sent, then load) for a request; the nodes' roles and loads are
    read as each request arrives, as the router reads its peers' heartbeats (a role may change
    during a run)."""

    def __init__(self, clock: Callable[[], float], balance: PrefillBalance | None = None) -> None:
        self.peers = PeerSet(clock)
        self.router = Router(self.peers, balance=balance)

    def pick(self, nodes: Sequence[RoutedNode], keys: list[bytes]) -> tuple[int, int, int] | None:
        """(decode node, prefill node, prefix blocks the router matched), by index in `nodes`;
        None while the cluster has no prefill and decode node."""
        for n in nodes:
            self.peers.upsert(n.info(), math.inf)
        index = {n.node_id: i for i, n in enumerate(nodes)}
        decode = self.router.pick_node(MODEL)
        if decode is None:
            return None
        prefill = self.router.pick_prefill(FINGERPRINT, keys)
        if prefill is None:
            return None
        self.router.in_flight[decode.node_id] += 1
        return index[decode.node_id], index[prefill.node.node_id], prefill.matched_blocks

    def done(self, node: RoutedNode) -> None:
        """A request routed to the decode node `node` has finished."""
        self.router.in_flight[node.node_id] -= 1

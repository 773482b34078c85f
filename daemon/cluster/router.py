"""The router's choices: a node to serve a request (a decode node, or a unified one that
computes its prompt itself; by free KV and running requests) and a prefill node for a handoff
(longest cached prefix while its node is not much busier than the least busy, then load),
among the live peers of one model."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from daemon.cluster.node import NodeInfo
from daemon.cluster.peers import PeerSet
from daemon.cluster.prefix_index import PrefixIndex


@dataclass(frozen=True)
class PrefillBalance:
    """How much busier (running + waiting requests) than the least busy prefill node a node
    may be and still be preferred for the prefix it was sent: at most `rel` times the least,
    or `abs` more, whichever is larger (SGLang's cache-aware router balances by such a pair of
    thresholds). Past that, load decides: a prefix every request shares (a system prompt) would
    otherwise send every prefill to the node that got the first one."""

    rel: float = 1.5
    abs: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.rel < float("inf"):
            raise ValueError(f"the relative bound must be a number >= 1, not {self.rel}")
        if self.abs < 0:
            raise ValueError(f"the absolute bound must be >= 0 requests, not {self.abs}")

    def within(self, load: int, least: int) -> bool:
        return load <= max(self.rel * least, least + self.abs)


@dataclass(frozen=True)
class PrefillRoute:
    node: NodeInfo
    matched_blocks: int


# the roles a request is sent to: a decode node fetches its prompt's KV from a prefill node, a
# unified node computes it (behind one router, a plain load balancer of unified nodes)
SERVING_ROLES = ("decode", "unified")


class Router:
    """A request goes to a serving node (SERVING_ROLES) of its `model`, a handoff to a prefill
    node of the decode node's fingerprint. A node that drains (its heartbeat says so, or this
    router is moving it to another role: `moving`) gets nothing new."""

    def __init__(
        self,
        peers: PeerSet,
        index: PrefixIndex | None = None,
        balance: PrefillBalance | None = None,
    ) -> None:
        self.peers = peers
        self.index = index or PrefixIndex()
        self.balance = balance or PrefillBalance()
        # requests this router has open on each node (its own view; loads come by heartbeat)
        self.in_flight: Counter[str] = Counter()
        self._routed: Counter[str] = Counter()  # prefill routes, a tie-breaker
        # prefill routes to each node since the heartbeat its load came with: (beat, routes)
        self._unreported: dict[str, tuple[int | None, int]] = {}
        self.moving: set[str] = set()  # nodes this router's autoscaler is changing the role of

    def _open(self, n: NodeInfo) -> bool:
        return not n.load.get("draining") and n.node_id not in self.moving

    def models(self) -> list[str]:
        """The served model names of the live serving nodes."""
        return sorted({n.served_model for n in self.serving()})

    def served_models(self) -> set[str]:
        """The served model names of every live node, whatever its role."""
        return {n.served_model for n in self.peers.live()}

    def serving_nodes(self, model: str) -> list[NodeInfo]:
        return [n for n in self.serving() if n.served_model == model]

    def serving(self) -> list[NodeInfo]:
        return [n for n in self.peers.live() if n.role in SERVING_ROLES]

    def pick_node(self, model: str, exclude: set[str] = frozenset()) -> NodeInfo | None:
        nodes = [n for n in self.serving_nodes(model) if n.node_id not in exclude and self._open(n)]
        if not nodes:
            return None
        return min(nodes, key=lambda n: (self._load(n), n.node_id))

    def _load(self, n: NodeInfo) -> float:
        """Busy share of the request slots minus the free share of the KV blocks."""
        seqs = max(n.capacity.get("max_num_seqs", 1), 1)
        blocks = max(n.capacity.get("kv_blocks", 1), 1)
        busy = n.load.get("running", 0) + n.load.get("waiting", 0) + self.in_flight[n.node_id]
        return busy / seqs - n.load.get("kv_blocks_free", 0) / blocks

    def pick_prefill(self, fingerprint: str, keys: list[bytes]) -> PrefillRoute | None:
        """The prefill node that was sent the longest prefix of `keys` among those within the
        balance bound of the least loaded (`PrefillBalance`), then the least loaded; the keys
        are then noted for it (its prefix cache and the shared store will hold them)."""
        nodes = [n for n in self.peers.live("prefill", fingerprint) if self._open(n)]
        self.index.forget({n.node_id for n in self.peers.live("prefill")})
        if not nodes:
            return None
        matched = {n.node_id: self.index.match(n.node_id, keys) for n in nodes}
        # a heartbeat's load plus what was sent since: between two heartbeats (seconds) every
        # prompt would otherwise go to the node that looked least loaded at the last one
        loads = {
            n.node_id: n.load.get("running", 0) + n.load.get("waiting", 0) + self._since(n.node_id)
            for n in nodes
        }
        least = min(loads.values())

        def rank(n: NodeInfo) -> tuple[int, int, int, str]:
            load = loads[n.node_id]
            held = matched[n.node_id] if self.balance.within(load, least) else 0
            return (-held, load, self._routed[n.node_id], n.node_id)

        node = min(nodes, key=rank)
        self.index.add(node.node_id, keys)
        self._routed[node.node_id] += 1
        self._unreported[node.node_id] = (
            self.peers.beat(node.node_id), self._since(node.node_id) + 1
        )  # fmt: skip
        return PrefillRoute(node, matched[node.node_id])

    def _since(self, node_id: str) -> int:
        """Prefill routes to `node_id` that its last heartbeat's load does not count."""
        beat, routes = self._unreported.get(node_id, (None, 0))
        return routes if beat == self.peers.beat(node_id) else 0

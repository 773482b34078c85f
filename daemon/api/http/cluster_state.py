"""What the router's handlers share: the routing choices, the client session to the nodes, the
router's own URL and lease for handoffs, its metrics and its recent stream latencies."""

from __future__ import annotations

from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from daemon.cluster.router import Router
from daemon.cluster.slo_window import SloWindow


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "deepinfer:router_requests",
            "Requests routed to a decode node, by path.",
            ["path"],
            registry=self.registry,
        )
        self.retries = Counter(
            "deepinfer:router_retries",
            "Requests sent to a second decode node after the first failed before answering.",
            registry=self.registry,
        )
        self.failures = Counter(
            "deepinfer:router_failures",
            "Decode node failures seen by the router, by reason (stream_*: after bytes were sent).",
            ["reason"],
            registry=self.registry,
        )
        self.prefill_routes = Counter(
            "deepinfer:router_prefill_routes",
            "Prefill nodes chosen for a handoff, by whether one had been sent the prefix.",
            ["prefix"],
            registry=self.registry,
        )


@dataclass
class RouterState:
    router: Router
    url: str  # this router's base URL, told to decode nodes for their handoff routes
    lease_ms: int  # how long a handoff's KV may be used after the prefill node starts it
    created: int  # unix time the router started
    api_key: str | None = field(default=None, repr=False)
    # a request waiting on a node that left the peer set is given up after this long (with no
    # byte from it and no registration again meanwhile)
    lost_grace_s: float = 60.0
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    # the proxied streams' TTFT / TPOT (the autoscaler's latency inputs)
    slo: SloWindow = field(default_factory=lambda: SloWindow(10.0))
    session: aiohttp.ClientSession = field(init=False)  # made on the app's startup


ROUTER: web.AppKey[RouterState] = web.AppKey("deepinfer_router", RouterState)

"""The router's P:D autoscaler at work (`--autoscale`): every window it reads its inputs, asks
the policy (cluster/autoscale.py) and carries out a move through the chosen node's admin HTTP
call (`POST /admin/v1/role`, the bearer admin token). Each decision is logged with its inputs
and counted in the router's /metrics, its inputs as gauges."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

import aiohttp
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from daemon.api.http.admin_http import ROLE_PATH
from daemon.api.http.cluster_state import RouterState
from daemon.cluster.autoscale import KINDS, Autoscaler, Decision
from daemon.cluster.autoscale_inputs import window_inputs

log = structlog.get_logger(__name__)

CALL_MARGIN_S = 10.0  # the admin call's timeout past the node's drain timeout
_INPUTS = (
    "ttft_p99_s", "tpot_p99_s", "decode_kv_util", "prefill_queue", "decode_queue", "samples",
)  # fmt: skip


class AutoscaleMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "deepinfer:autoscale_decisions",
            "Autoscaler decisions, by kind (hold, prefill_to_decode, decode_to_prefill).",
            ["kind"],
            registry=registry,
        )
        self.moves = Counter(
            "deepinfer:autoscale_moves",
            "Role changes the autoscaler asked a node for, by result (ok, failed).",
            ["result"],
            registry=registry,
        )
        self.nodes = Gauge(
            "deepinfer:autoscale_nodes",
            "Live nodes by role at the last decision (draining ones left out).",
            ["role"],
            registry=registry,
        )
        self.inputs = Gauge(
            "deepinfer:autoscale_input",
            "The last decision's inputs (NaN: no sample in the window).",
            ["name"],
            registry=registry,
        )
        self.pressure = Gauge(
            "deepinfer:autoscale_pressure",
            "The last decision's pressure (measured / target) by side.",
            ["side"],
            registry=registry,
        )
        for kind in KINDS:
            self.decisions.labels(kind)
        for result in ("ok", "failed"):
            self.moves.labels(result)

    def observe(self, d: Decision) -> None:
        self.decisions.labels(d.kind).inc()
        for role in ("prefill", "decode"):
            self.nodes.labels(role).set(d.inputs.count(role))
        for name in _INPUTS:
            value = getattr(d.inputs, name)
            self.inputs.labels(name).set(math.nan if value is None else float(value))
        self.pressure.labels("prefill").set(d.prefill_pressure)
        self.pressure.labels("decode").set(d.decode_pressure)


class RouterAutoscaler:
    def __init__(
        self,
        state: RouterState,
        policy: Autoscaler,
        window_s: float,
        admin_token: str,
        drain_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.state, self.policy, self.window_s, self.clock = state, policy, window_s, clock
        self.metrics = AutoscaleMetrics(state.metrics.registry)
        self._headers = {"Authorization": f"Bearer {admin_token}"}
        self._timeout = aiohttp.ClientTimeout(total=drain_timeout_s + CALL_MARGIN_S)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.window_s)
            await self.tick()

    async def tick(self) -> Decision:
        router = self.state.router
        d = self.policy.decide(window_inputs(router.peers, self.state.slo, self.clock()))
        self.metrics.observe(d)
        log.info("autoscale_decision", **d.to_json())
        if d.node_id is not None and await self._move(d, d.node_id):
            self.policy.moved(d, self.clock())
        return d

    async def _move(self, d: Decision, node_id: str) -> bool:
        router = self.state.router
        node = router.peers.get(node_id)
        if node is None:
            return False
        role = "decode" if d.kind == "prefill_to_decode" else "prefill"
        router.moving.add(node_id)  # nothing new routed there while it drains
        try:
            async with self.state.session.post(
                node.url + ROLE_PATH, json={"role": role}, headers=self._headers,
                timeout=self._timeout,
            ) as resp:  # fmt: skip
                text = (await resp.text(errors="replace"))[:500]
                ok = resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            ok, text = False, repr(e)
        finally:
            router.moving.discard(node_id)
        self.metrics.moves.labels("ok" if ok else "failed").inc()
        if ok:
            log.info("autoscale_moved", node_id=node_id, role=role, answer=text)
        else:
            log.warning("autoscale_move_failed", node_id=node_id, role=role, error=text)
        return ok

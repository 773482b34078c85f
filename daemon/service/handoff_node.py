"""A prefill or decode daemon's part in KV handoffs: its model fingerprint and epoch (as it
registers them), its live role, the routers it takes routed requests from, the handoff's
timeout."""

from __future__ import annotations

from typing import cast

from daemon.api.http.cluster_handoff import HandoffConfig
from daemon.cluster.config import ClusterConfig
from daemon.cluster.live_role import LiveRole
from daemon.cluster.node import PROCESS_EPOCH, Role


def handoff_config(
    cluster: ClusterConfig, fingerprint: str, api_key: str | None
) -> HandoffConfig | None:
    """None for a unified node (it takes no part in handoffs)."""
    if cluster.role not in ("prefill", "decode"):
        return None
    return HandoffConfig(
        LiveRole(cast(Role, cluster.role)),
        fingerprint,
        PROCESS_EPOCH,
        routers=tuple(url.rstrip("/") for url in cluster.routers or cluster.peers),
        timeout_s=cluster.handoff_timeout_s,
        api_key=api_key,
    )

"""A prefill or decode daemon's part in KV handoffs: its model fingerprint and epoch (as it
registers them), the routers it takes routed requests from, the handoff's timeout."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import cast

from daemon.api.http.cluster_handoff import HandoffConfig
from daemon.cluster.config import ClusterConfig
from daemon.cluster.fingerprint import kv_layout, model_fingerprint
from daemon.cluster.live_role import LiveRole
from daemon.cluster.node import PROCESS_EPOCH, Role
from daemon.loop.engine import Engine
from daemon.models.loader import read_config


async def handoff_config(
    cluster: ClusterConfig, engine: Engine, model_dir: Path, api_key: str | None
) -> HandoffConfig | None:
    """None for a unified node (it takes no part in handoffs). The fingerprint reads files: in
    a thread."""
    if cluster.role not in ("prefill", "decode"):
        return None
    layout = kv_layout(engine.kv.groups)
    fingerprint = await asyncio.to_thread(
        lambda: model_fingerprint(model_dir, read_config(model_dir), layout)
    )
    return HandoffConfig(
        LiveRole(cast(Role, cluster.role)),
        fingerprint,
        PROCESS_EPOCH,
        routers=tuple(url.rstrip("/") for url in cluster.peers),
        timeout_s=cluster.handoff_timeout_s,
        api_key=api_key,
    )

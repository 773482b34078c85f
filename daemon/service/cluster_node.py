"""This daemon as a cluster node: its model fingerprint, its NodeInfo (fingerprint, address,
capacity) and its load, read from the engine for each heartbeat."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import cast

from daemon.cluster.config import ClusterConfig, advertise_url, node_id
from daemon.cluster.fingerprint import kv_layout, model_fingerprint
from daemon.cluster.node import PROCESS_EPOCH, NodeInfo, Role
from daemon.loop.engine import Engine
from daemon.models.loader import read_config


async def fingerprint_of(engine: Engine, model_dir: Path, gguf_cache: Path | None) -> str:
    """The model and KV layout's fingerprint; it reads files: in a thread. `gguf_cache`: where
    a GGUF file's config was kept (build_engine's)."""
    layout = kv_layout(engine.kv.groups)
    return await asyncio.to_thread(
        lambda: model_fingerprint(model_dir, read_config(model_dir, gguf_cache), layout)
    )


def local_node(
    cfg: ClusterConfig,
    engine: Engine,
    served_name: str,
    fingerprint: str,
    host: str,
    port: int,
    max_num_seqs: int,
) -> NodeInfo:
    """`port`: the one bound (the settings may say 0)."""
    return NodeInfo(
        node_id=node_id(cfg, port),
        role=cast(Role, cfg.role),
        fingerprint=fingerprint,
        url=advertise_url(cfg, host, port),
        epoch=PROCESS_EPOCH,
        served_model=served_name,
        capacity={
            "kv_blocks": int(cast(int, engine.stats()["kv_blocks_total"])),
            "max_num_seqs": max_num_seqs,
        },
        load=engine_load(engine),
    )


def engine_load(engine: Engine) -> dict[str, int]:
    stats = engine.stats()
    return {
        "running": int(cast(int, stats["running"])),
        # requests reading the block store wait too
        "waiting": int(cast(int, stats["waiting"])) + int(cast(int, stats["loading"])),
        "kv_blocks_free": int(cast(int, stats["kv_blocks_free"])),
    }

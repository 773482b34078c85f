"""What a node is in a cluster ([cluster] settings): its role, how it finds peers, its lease."""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from daemon.cluster.autoscale import Targets
from daemon.cluster.router import PrefillBalance

# a node id is a path segment (/cluster/v1/nodes/<id>) and an etcd key's last part
NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass
class ClusterConfig:
    # unified: today's node on its own (registers only when given peers); prefill / decode: a
    # disaggregated node that registers; router: no model, serves the APIs by proxy; encoder:
    # also serves a vision model's image embeddings to other nodes
    role: str = "unified"
    peers: list[str] = field(default_factory=list)  # registries (router, seed peers): base URLs
    # the routers a decode node takes routed requests (and asks prefill routes) from; default:
    # its peers (with etcd discovery, where it has none, name them here)
    routers: list[str] = field(default_factory=list)
    discovery: str = "http"  # http (register with the peers) | etcd://HOST:PORT
    advertise_url: str | None = None  # how peers reach this node (default http://host:port)
    node_id: str | None = None  # default: <role>-<hostname>-<port>
    lease_s: float = 6.0  # a node whose lease lapses leaves the set; heartbeats every lease/3
    handoff_timeout_s: float = 30.0  # a KV handoff not done by then is recomputed locally
    # the router: a request on a node whose lease lapsed goes on while the node sends bytes or
    # registers again; given up once the node has been gone this long with neither
    lost_node_grace_s: float = 60.0
    # encoder nodes (`--role encoder`: a vision model's tower for others) that encode this
    # node's images, tried in turn; none: encoded here
    image_encoders: list[str] = field(default_factory=list)
    image_encode_timeout_s: float = 10.0  # per encoder tried
    handoff_min_tokens: int = 2  # a decode node computes shorter prompts itself, no handoff
    # full blocks go through the block store (both nodes' --kv-store-dir, the same store) and
    # only the rest over HTTP; off: every block over HTTP
    handoff_store: bool = True
    handoff_store_wait_s: float = (
        1.0  # a prefill node sends a block whose write is not done by then
    )
    role_drain_timeout_s: float = 60.0  # a live role change not drained by then is undone
    # a router's prefill route: the node sent a prompt's prefix is preferred while its load is
    # within this many times the least loaded prefill node's, or this many requests more
    prefill_balance_rel: float = PrefillBalance.rel
    prefill_balance_abs: int = PrefillBalance.abs
    # the router's P:D autoscaler (cluster/autoscale.py): off unless asked for
    autoscale: bool = False
    autoscale_window_s: float = 10.0  # the p99s are over this window; a decision each window
    autoscale_ttft_p99_s: float = 2.0
    autoscale_tpot_p99_s: float = 0.1
    autoscale_kv_util: float = 0.85
    autoscale_queue_per_node: float = 8.0
    autoscale_up: float = 1.0  # pressure (measured / target) above which a side needs a node
    autoscale_down: float = 0.6  # and below which it can give one
    autoscale_node_dwell_s: float = 60.0
    autoscale_global_dwell_s: float = 20.0


def autoscale_targets(cfg: ClusterConfig) -> Targets:
    """The policy's targets from the settings; ValueError names what is wrong."""
    return Targets(
        ttft_p99_s=cfg.autoscale_ttft_p99_s,
        tpot_p99_s=cfg.autoscale_tpot_p99_s,
        kv_util=cfg.autoscale_kv_util,
        queue_per_node=cfg.autoscale_queue_per_node,
        up=cfg.autoscale_up,
        down=cfg.autoscale_down,
        node_dwell_s=cfg.autoscale_node_dwell_s,
        global_dwell_s=cfg.autoscale_global_dwell_s,
    )


def prefill_balance(cfg: ClusterConfig) -> PrefillBalance:
    """The router's prefill balance from the settings; ValueError names what is wrong."""
    return PrefillBalance(cfg.prefill_balance_rel, cfg.prefill_balance_abs)


def etcd_endpoint(discovery: str) -> tuple[str, int] | None:
    """(host, port) of `etcd://HOST:PORT`; None for `http`. ValueError for anything else."""
    if discovery == "http":
        return None
    parts = urlsplit(discovery)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "etcd" or not parts.hostname or port is None or parts.path not in ("", "/"):
        raise ValueError(f"{discovery!r} is neither http nor etcd://HOST:PORT")
    return parts.hostname, port


def base_url(url: str) -> str:
    """`url` checked to be an http(s) base URL (no query), without its trailing slash."""
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 (raises for a bad port)
    except ValueError:
        raise ValueError(f"{url!r} has a bad port") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query:
        raise ValueError(f"{url!r} is not an http:// or https:// base URL")
    return url.rstrip("/")


def advertise_url(cfg: ClusterConfig, host: str, port: int) -> str:
    """The URL peers reach this node at: `advertise_url`, else the listening address."""
    if cfg.advertise_url:
        return base_url(cfg.advertise_url)
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def node_id(cfg: ClusterConfig, port: int) -> str:
    if cfg.node_id:
        return cfg.node_id
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:96]
    return f"{cfg.role}-{host}-{port}"

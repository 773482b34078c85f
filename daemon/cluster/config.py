"""What a node is in a cluster ([cluster] settings): its role, how it finds peers, its lease."""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass, field
from urllib.parse import urlsplit

# a node id is a path segment (/cluster/v1/nodes/<id>) and an etcd key's last part
NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass
class ClusterConfig:
    # unified: today's node on its own (registers only when given peers); prefill / decode: a
    # disaggregated node that registers; router: no model, serves the APIs by proxy; encoder:
    # also serves a vision model's image embeddings to other nodes
    role: str = "unified"
    peers: list[str] = field(default_factory=list)  # registries (router, seed peers): base URLs
    discovery: str = "http"  # http (register with the peers) | etcd://HOST:PORT
    advertise_url: str | None = None  # how peers reach this node (default http://host:port)
    node_id: str | None = None  # default: <role>-<hostname>-<port>
    lease_s: float = 6.0  # a node whose lease lapses leaves the set; heartbeats every lease/3
    handoff_timeout_s: float = 30.0  # a KV handoff not done by then is recomputed locally
    # encoder nodes (`--role encoder`: a vision model's tower for others) that encode this
    # node's images, tried in turn; none: encoded here
    image_encoders: list[str] = field(default_factory=list)
    image_encode_timeout_s: float = 10.0  # per encoder tried


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

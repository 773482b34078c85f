"""The discovery a node's settings ask for: an Announcer for a node that registers, a PeerFeed
for a router whose peers are in etcd (over HTTP they arrive on the registration routes)."""

from __future__ import annotations

from typing import Protocol

from daemon.cluster.announce import Announcer, Load
from daemon.cluster.config import ClusterConfig, etcd_endpoint
from daemon.cluster.etcd import EtcdAnnouncer, EtcdPeerFeed
from daemon.cluster.node import NodeInfo
from daemon.cluster.peers import PeerSet
from daemon.cluster.registrar import HttpRegistrar


class PeerFeed(Protocol):
    async def start(self) -> None: ...
    async def stop(self) -> None: ...


def registers(cfg: ClusterConfig) -> bool:
    """Prefill and decode nodes always; a unified or encoder one when told where (peers or
    etcd)."""
    if cfg.role in ("prefill", "decode"):
        return True
    return cfg.role in ("unified", "encoder") and (bool(cfg.peers) or cfg.discovery != "http")


def announcer(
    cfg: ClusterConfig, info: NodeInfo, load: Load, api_key: str | None = None
) -> Announcer:
    etcd = etcd_endpoint(cfg.discovery)
    if etcd is not None:
        return EtcdAnnouncer(info, *etcd, cfg.lease_s, load)
    return HttpRegistrar(info, cfg.peers, cfg.lease_s, load, api_key)


def peer_feed(cfg: ClusterConfig, peers: PeerSet) -> PeerFeed | None:
    """etcd's nodes into `peers`; None with HTTP discovery (nodes register themselves)."""
    etcd = etcd_endpoint(cfg.discovery)
    return EtcdPeerFeed(peers, *etcd, cfg.lease_s) if etcd is not None else None

"""NodeInfo's JSON (checked on the way in) and the PeerSet's leases, by a clock the test moves."""

from __future__ import annotations

import pytest

from daemon.cluster.node import NodeInfo, NodeInfoError
from daemon.cluster.peers import PeerSet


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def node(node_id: str = "p0", role: str = "prefill", fp: str = "fp-a", epoch: int = 1) -> NodeInfo:
    return NodeInfo.from_json(
        {
            "node_id": node_id,
            "role": role,
            "fingerprint": fp,
            "url": f"http://127.0.0.1:81{len(node_id)}/",
            "epoch": epoch,
            "served_model": "tiny",
            "capacity": {"kv_blocks": 64, "max_num_seqs": 8},
            "load": {"running": 0, "waiting": 0, "kv_blocks_free": 64},
        }
    )


def test_json_round_trip() -> None:
    info = node()
    assert info.url == "http://127.0.0.1:812"  # the trailing slash goes
    assert NodeInfo.from_json(info.to_json()) == info


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"role": "gateway"}, "role"),
        ({"node_id": ""}, "node_id"),
        ({"url": "127.0.0.1:8000"}, "url"),
        ({"epoch": -1}, "epoch"),
        ({"epoch": True}, "epoch"),
        ({"load": {"running": "2"}}, "load.running"),
        ({"capacity": []}, "capacity"),
    ],
)
def test_bad_node_names_the_field(change: dict, message: str) -> None:
    with pytest.raises(NodeInfoError, match=message):
        NodeInfo.from_json(node().to_json() | change)
    with pytest.raises(NodeInfoError):
        NodeInfo.from_json(["not", "an", "object"])


def test_lease_lapses_without_heartbeat() -> None:
    clock = Clock()
    peers = PeerSet(clock)
    peers.upsert(node("p0"), ttl_s=6)
    peers.upsert(node("d0", role="decode"), ttl_s=6)
    assert [n.node_id for n in peers.live()] == ["d0", "p0"]
    clock.now += 4
    assert peers.renew("d0", {"running": 3, "waiting": 1, "kv_blocks_free": 10})
    assert peers.get("d0").load == {"running": 3, "waiting": 1, "kv_blocks_free": 10}
    clock.now += 2.5  # p0's lease lapsed; d0's runs to 110
    assert [n.node_id for n in peers.live()] == ["d0"]
    assert peers.get("p0") is None
    assert not peers.renew("p0", {})  # unknown: register again
    assert peers.expires_in("d0") == pytest.approx(3.5)
    clock.now += 3.5
    assert peers.live() == [] and peers.get("d0") is None


def test_filters_by_role_and_fingerprint() -> None:
    peers = PeerSet(Clock())
    peers.upsert(node("p0", fp="fp-a"), 6)
    peers.upsert(node("p1", fp="fp-b"), 6)
    peers.upsert(node("d0", role="decode", fp="fp-a"), 6)
    assert [n.node_id for n in peers.live(role="prefill")] == ["p0", "p1"]
    assert [n.node_id for n in peers.live(role="prefill", fingerprint="fp-a")] == ["p0"]
    assert [n.node_id for n in peers.live(fingerprint="fp-b")] == ["p1"]
    assert peers.live(role="router") == []


def test_remove_and_epochs() -> None:
    clock = Clock()
    peers = PeerSet(clock)
    peers.upsert(node("p0", epoch=5), 6)
    peers.upsert(node("p0", epoch=4), 6)  # an older process of the same node: ignored
    assert peers.get("p0").epoch == 5
    peers.upsert(node("p0", epoch=7), 6)  # restarted
    assert peers.get("p0").epoch == 7
    peers.remove("p0")
    peers.remove("p0")  # twice is fine
    assert peers.get("p0") is None
    peers.upsert(node("p0", epoch=4), 6)  # once gone, any epoch registers
    assert peers.get("p0").epoch == 4
    with pytest.raises(ValueError):
        peers.upsert(node("p1"), 0)


def test_lapsed_nodes_are_remembered_for_a_while_unless_they_left() -> None:
    clock = Clock()
    peers = PeerSet(clock)
    peers.upsert(node("d0", "decode"), ttl_s=3)
    peers.upsert(node("d1", "decode"), ttl_s=3)
    peers.upsert(node("d2", "decode"), ttl_s=30)
    peers.remove("d1")  # left: not waited for
    clock.now += 4
    assert [n.node_id for n in peers.live()] == ["d2"]
    assert [n.node_id for n in peers.lapsed_since(10)] == ["d0"]
    clock.now += 8  # lapsed 9 s ago
    assert [n.node_id for n in peers.lapsed_since(10)] == ["d0"]
    assert peers.lapsed_since(5) == []  # forgotten past that
    peers.upsert(node("d3", "decode"), ttl_s=3)
    clock.now += 4
    peers.upsert(node("d3", "decode"), ttl_s=3)  # came back: no longer lapsed
    assert peers.lapsed_since(10) == []

"""The router's choices over a PeerSet: decode nodes by free KV and running requests, prefill
nodes by the longest prefix routed to them (a bounded LRU), then by load; models and
fingerprints never mix."""

from __future__ import annotations

from daemon.cluster.node import NodeInfo
from daemon.cluster.peers import PeerSet
from daemon.cluster.prefix_index import PrefixIndex
from daemon.cluster.router import PrefillBalance, Router


def _node(node_id: str, role: str, fp: str = "fp", model: str = "m", **load: int) -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        role=role,  # type: ignore[arg-type]
        fingerprint=fp,
        url=f"http://{node_id}:1",
        epoch=1,
        served_model=model,
        capacity={"kv_blocks": 100, "max_num_seqs": 10},
        load={"running": 0, "waiting": 0, "kv_blocks_free": 100} | load,
    )


def _router(*nodes: NodeInfo) -> Router:
    peers = PeerSet()
    for n in nodes:
        peers.upsert(n, 60)
    return Router(peers)


KEYS = [bytes([i]) * 16 for i in range(6)]


def test_a_decode_node_is_picked_by_free_blocks_and_running_requests() -> None:
    r = _router(
        _node("d1", "decode", running=5, kv_blocks_free=50),
        _node("d2", "decode", running=1, kv_blocks_free=80),
        _node("d3", "decode", model="other"),
        _node("p1", "prefill"),
    )
    assert r.pick_node("m").node_id == "d2"
    assert r.pick_node("m", exclude={"d2"}).node_id == "d1"
    assert r.pick_node("m", exclude={"d1", "d2"}) is None
    assert r.pick_node("nope") is None
    assert r.models() == ["m", "other"]
    r.in_flight["d2"] += 9  # what this router has sent there since
    assert r.pick_node("m").node_id == "d1"


def test_unified_nodes_are_served_through_like_decode_nodes() -> None:
    r = _router(
        _node("u1", "unified", running=4),
        _node("u2", "unified", model="solo", running=1),
        _node("d1", "decode", running=6),
        _node("p1", "prefill", model="prefill-only"),
    )
    assert r.models() == ["m", "solo"]  # a prefill node serves no request itself
    assert r.pick_node("m").node_id == "u1"
    assert r.pick_node("m", exclude={"u1"}).node_id == "d1"
    assert r.pick_node("solo").node_id == "u2"
    assert r.pick_node("prefill-only") is None


def test_a_prefill_node_is_picked_by_its_prefix_then_by_load() -> None:
    r = _router(_node("p1", "prefill", running=3), _node("p2", "prefill"), _node("d", "decode"))
    first = r.pick_prefill("fp", KEYS[:4])
    assert (first.node.node_id, first.matched_blocks) == ("p2", 0)  # the idle one
    again = r.pick_prefill("fp", KEYS)  # the same prefix, longer
    assert (again.node.node_id, again.matched_blocks) == ("p2", 4)
    other = r.pick_prefill("fp", [bytes([9]) * 16])
    assert other.node.node_id == "p2"  # no match anywhere: load (then routes so far) decides
    assert r.pick_prefill("other-fp", KEYS) is None


def test_prefill_routes_since_a_heartbeat_count_as_load_until_the_next_one() -> None:
    # heartbeats come every few seconds: between two, the node that looked idle at the last
    # one must not take every prompt (measured: 8 waiting on one node, the other idle)
    r = _router(_node("p1", "prefill"), _node("p2", "prefill", running=2))
    picks = [r.pick_prefill("fp", [bytes([i]) * 16]).node.node_id for i in range(6)]
    assert picks == ["p1", "p1", "p2", "p1", "p2", "p1"]
    assert r.peers.renew("p1", {"running": 1})  # p1's new load holds what it was sent
    assert r.pick_prefill("fp", [bytes([9]) * 16]).node.node_id == "p1"  # 1 + 0 against 2 + 2
    assert r.peers.beat("nope") is None


def test_a_prefix_goes_where_it_was_sent_even_to_a_busier_node() -> None:
    r = _router(_node("p1", "prefill"), _node("p2", "prefill"))
    r.index.add("p1", KEYS[:3])
    r.peers.upsert(_node("p1", "prefill", running=4), 60)
    assert r.pick_prefill("fp", KEYS).node.node_id == "p1"


def test_a_prefix_holder_far_busier_than_the_least_loaded_is_passed_over() -> None:
    # every prompt shares its first block (a system prompt): without a bound on the prefix
    # preference every prefill would go to the node that got the first one
    for holder, others, want in [
        (4, (0, 6), "p1"),  # within the least + 4
        (5, (0, 6), "p2"),  # past it: the least loaded
        (12, (8, 9), "p1"),  # within 1.5 x the least
        (13, (8, 9), "p2"),
    ]:
        r = _router(
            _node("p1", "prefill", running=holder - 1, waiting=1),
            _node("p2", "prefill", running=others[0]),
            _node("p3", "prefill", running=others[1]),
        )
        assert r.balance == PrefillBalance(1.5, 4)
        r.index.add("p1", KEYS[:1])
        route = r.pick_prefill("fp", KEYS[:1] + [bytes([7]) * 16])
        assert route.node.node_id == want, (holder, others)
        assert route.matched_blocks == (want == "p1")


def test_the_prefix_index_is_a_bounded_lru_per_node() -> None:
    index = PrefixIndex(max_keys_per_node=4)
    index.add("p", KEYS[:4])
    assert index.match("p", KEYS) == 4
    index.add("p", KEYS[4:6])  # the two oldest go
    assert index.size("p") == 4
    assert index.match("p", KEYS[:2]) == 0
    assert index.match("p", KEYS) == 6  # a chain key stands for its whole prefix
    index.forget({"q"})
    assert index.match("p", KEYS) == 0

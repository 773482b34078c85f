"""The sliding-window snapshot cache: LRU within its budget, and expired snapshots leave
without being looked up (memory follows the TTL under a stream of new conversations)."""

from __future__ import annotations

import time

from daemon.kv.swa_cache import SWACache


def test_expired_snapshots_leave_on_their_own() -> None:
    cache = SWACache(max_bytes=10_000, ttl_s=0.05)
    for i in range(5):
        cache.reserve(bytes([i]), 16, 100)
    assert cache.bytes == 500
    time.sleep(0.06)
    cache.reserve(b"new", 16, 100)
    assert list(cache.entries) == [b"new"] and cache.bytes == 100


def test_budget_evicts_least_recently_used() -> None:
    cache = SWACache(max_bytes=300, ttl_s=60)
    for key in (b"a", b"b", b"c"):
        cache.reserve(key, 16, 100)
    assert cache.get(b"a") is not None  # now the most recent
    cache.reserve(b"d", 16, 100)
    assert set(cache.entries) == {b"a", b"c", b"d"} and cache.get(b"b") is None

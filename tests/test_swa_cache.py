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


def test_a_use_restarts_the_ttl() -> None:
    """Retention counts from the last use: a snapshot looked up keeps living."""
    cache = SWACache(max_bytes=10_000, ttl_s=0.2)
    cache.reserve(b"used", 16, 100)
    cache.reserve(b"idle", 16, 100)
    time.sleep(0.12)
    assert cache.peek(b"used") is not None
    time.sleep(0.12)
    cache.sweep()
    assert list(cache.entries) == [b"used"]


def test_stats_account_memory_and_lookups() -> None:
    cache = SWACache(max_bytes=250, ttl_s=60)
    for key in (b"a", b"b", b"c"):
        cache.reserve(key, 16, 100)
    assert cache.get(b"c") is not None and cache.get(b"a") is None
    assert cache.peek(b"b") is not None  # uncounted
    s = cache.stats()
    assert (s["swa_hits"], s["swa_misses"], s["swa_hit_rate"]) == (1, 1, 0.5)
    assert (s["swa_cache_bytes"], s["swa_cache_snapshots"], s["swa_cache_peak_bytes"]) == (
        200,
        2,
        200,
    )
    assert (s["swa_cache_saves"], s["swa_cache_evictions"]) == (3, 1)
    assert cache.reserve(b"huge", 16, 251) is None  # past the whole budget: not kept

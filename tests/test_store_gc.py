"""Block-store retention: expired classes are swept, an agent block goes before a chat block
of the same age, the capacity watermark holds, and a block being read is never deleted."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from daemon.kv.block_store import BlockStore, StoreUsage
from daemon.kv.store_format import HEADER_BYTES
from daemon.kv.store_gc import STALE_TMP_S, StoreSweeper
from daemon.kv.traffic import DAY, TrafficClasses, parse_duration

BLOCK = 1024
FILE = HEADER_BYTES + BLOCK


@pytest.fixture
def store(tmp_path: Path):
    s = BlockStore(tmp_path, bytes(16), BLOCK)
    yield s
    s.close()


def put(store: BlockStore, i: int, cls: str, age_days: float, now: float) -> Path:
    key = i.to_bytes(16, "big")
    assert store.write(key, torch.full((BLOCK,), i % 256, dtype=torch.uint8), cls)
    path = store.path(key)
    t = now - age_days * DAY
    os.utime(path, (t, t))
    return path


def test_retention_by_class(store: BlockStore) -> None:
    now = time.time()
    fresh_chat = put(store, 1, "chat", 4, now)
    old_chat = put(store, 2, "chat", 8, now)
    fresh_agent = put(store, 3, "agent", 2, now)
    old_agent = put(store, 4, "agent", 4, now)
    batch = put(store, 5, "batch", 2, now)
    classes = TrafficClasses.from_specs(["batch=1d"])
    result = StoreSweeper(store, classes, capacity_bytes=0).sweep(now)
    assert result.expired == 3
    assert fresh_chat.exists() and fresh_agent.exists()
    assert not old_chat.exists() and not old_agent.exists() and not batch.exists()


def test_unknown_class_gets_the_default_retention(store: BlockStore) -> None:
    now = time.time()
    young, old = put(store, 1, "other", 6, now), put(store, 2, "other", 8, now)
    StoreSweeper(store, TrafficClasses(), 0).sweep(now)
    assert young.exists() and not old.exists()


def test_agent_goes_before_chat_of_the_same_age(store: BlockStore) -> None:
    now = time.time()
    chat = [put(store, i, "chat", 1, now) for i in range(4)]
    agent = [put(store, 10 + i, "agent", 1, now) for i in range(4)]
    # room for 6 blocks; above 90% (5.4 blocks) evict down to 80% (4.8): 4 must go
    sweeper = StoreSweeper(store, TrafficClasses(), 6 * FILE, 0.9, 0.8)
    result = sweeper.sweep(now)
    assert result.evicted == 4 and result.bytes <= 0.8 * 6 * FILE
    assert result.files == 4  # what the store reports now is this sweep's count
    assert store.usage == StoreUsage(result.files, result.bytes)
    assert all(p.exists() for p in chat) and not any(p.exists() for p in agent)


def test_watermark_evicts_oldest_use_first(store: BlockStore) -> None:
    now = time.time()
    paths = [put(store, i, "chat", age, now) for i, age in enumerate([5, 1, 3, 0.5, 2, 4])]
    result = StoreSweeper(store, TrafficClasses(), 5 * FILE, 0.9, 0.5).sweep(now)
    assert result.bytes <= 0.5 * 5 * FILE and result.files == 2
    survivors = [i for i, p in enumerate(paths) if p.exists()]
    assert survivors == [1, 3]  # the two most recently used


def test_a_block_being_read_is_not_deleted(store: BlockStore) -> None:
    now = time.time()
    path = put(store, 1, "agent", 10, now)
    with store._mark_reading(str(path)):
        result = StoreSweeper(store, TrafficClasses(), 0).sweep(now)
    assert path.exists() and result.skipped_in_use == 1
    StoreSweeper(store, TrafficClasses(), 0).sweep(now)
    assert not path.exists()


def test_a_block_used_since_the_scan_is_not_deleted(store: BlockStore) -> None:
    now = time.time()
    path = put(store, 1, "agent", 10, now)
    sweeper = StoreSweeper(store, TrafficClasses(), 0)
    blocks = sweeper._scan(now)
    os.utime(path)  # read by another daemon meanwhile
    from daemon.kv.store_gc import SweepResult

    assert not sweeper._remove(blocks[0], SweepResult()) and path.exists()


def test_reads_refresh_retention(tmp_path: Path) -> None:
    store = BlockStore(tmp_path, bytes(16), BLOCK, touch_interval_s=0)
    now = time.time()
    path = put(store, 1, "agent", 10, now)
    assert store.read((1).to_bytes(16, "big")) is not None
    StoreSweeper(store, TrafficClasses(), 0).sweep()
    assert path.exists()
    store.close()


def test_stale_temporary_files_are_removed(store: BlockStore) -> None:
    now = time.time()
    put(store, 1, "chat", 0, now)
    shard = next(store.dir.iterdir())
    stale, fresh = shard / "x.kvb.tmp.1.a", shard / "y.kvb.tmp.1.b"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    os.utime(stale, (now - STALE_TMP_S - 1, now - STALE_TMP_S - 1))
    StoreSweeper(store, TrafficClasses(), 0).sweep(now)
    assert not stale.exists() and fresh.exists()


def test_traffic_class_specs() -> None:
    classes = TrafficClasses.from_specs(["batch=12h", "agent=1d", "scratch=0"])
    assert classes.retention("batch") == 12 * 3600 and classes.retention("agent") == DAY
    assert classes.retention("chat") == 7 * DAY and classes.retention("scratch") == 0
    assert parse_duration("90s") == 90 and parse_duration("30m") == 1800
    for bad in ("nope", "Bad Name=1d", "x=-1d", "x=ten"):
        with pytest.raises(ValueError):
            TrafficClasses.from_specs([bad])


def test_a_fifo_in_the_store_is_swept_without_waiting(store: BlockStore) -> None:
    import threading

    now = time.time()
    kept = put(store, 1, "chat", 0, now)
    fifo = kept.with_name("ff" * 16 + ".kvb")
    os.mkfifo(fifo)
    os.utime(fifo, (now + 60, now + 60))  # garbage is swept whatever its mtime
    done = threading.Event()
    threading.Thread(
        target=lambda: (StoreSweeper(store, TrafficClasses(), 0).sweep(now), done.set()),
        daemon=True,
    ).start()
    try:
        assert done.wait(5), "the sweep waits on a FIFO"
        assert kept.exists() and not fifo.exists()
    finally:
        if fifo.exists():
            os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))  # frees a sweep stuck on it


def test_store_usage_is_current_between_sweeps(store: BlockStore) -> None:
    now = time.time()
    for i in range(3):
        put(store, i, "chat", 0, now)
    assert store.usage is None  # unknown before the first sweep
    StoreSweeper(store, TrafficClasses(), 0).sweep(now)
    assert (store.usage.files, store.usage.bytes) == (3, 3 * FILE)
    put(store, 10, "chat", 0, now)
    assert (store.usage.files, store.usage.bytes) == (4, 4 * FILE)
    path = store.path((10).to_bytes(16, "big"))
    raw = path.read_bytes()
    path.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))  # damaged: removed when read
    assert store.read((10).to_bytes(16, "big")) is None
    assert (store.usage.files, store.usage.bytes) == (3, 3 * FILE)

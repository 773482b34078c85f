"""The block store on real files: round trip, untrustworthy files are misses (and removed),
concurrent writers in separate processes never expose a torn block, and a full or
unwritable store skips writes, says so once and keeps serving."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import struct
import threading
import zlib
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from daemon.kv.block_store import BlockStore
from daemon.kv.store_format import HEADER_BYTES, VERSION
from tests.mounts import tmpfs

FINGERPRINT = bytes(range(16))
BLOCK_BYTES = 4096


def payload(seed: int, nbytes: int = BLOCK_BYTES) -> torch.Tensor:
    return torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_round_trip_and_first_writer_wins(tmp_path: Path) -> None:
    store = BlockStore(tmp_path, FINGERPRINT, BLOCK_BYTES)
    assert store.read(key(1)) is None
    assert store.write(key(1), payload(1), "chat")
    assert not store.write(key(1), payload(2), "agent")  # already published
    assert torch.equal(store.read(key(1)), payload(1))
    path = store.path(key(1))
    assert (
        path.stat().st_size == HEADER_BYTES + BLOCK_BYTES and path.parent.parent.parent == store.dir
    )
    assert store.counters.writes == 1 and store.counters.already_stored == 1
    assert not list(store.dir.rglob("*.tmp.*"))
    store.close()


def _rewrite_version(raw: bytes) -> bytes:
    fields = bytearray(raw[: HEADER_BYTES - 4])
    struct.pack_into("<I", fields, 8, VERSION + 1)
    return bytes(fields) + struct.pack("<I", zlib.crc32(fields)) + raw[HEADER_BYTES:]


DAMAGE = {
    "truncated": lambda raw: raw[: len(raw) // 2],
    "truncated header": lambda raw: raw[:10],
    "corrupted payload": lambda raw: raw[:-7] + bytes([raw[-7] ^ 0xFF]) + raw[-6:],
    "corrupted header": lambda raw: raw[:30] + bytes([raw[30] ^ 0x01]) + raw[31:],
    "wrong version": _rewrite_version,
    "empty": lambda raw: b"",
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_files_are_removed_misses(tmp_path: Path, damage: str) -> None:
    store = BlockStore(tmp_path, FINGERPRINT, BLOCK_BYTES)
    store.write(key(7), payload(7), "chat")
    path = store.path(key(7))
    path.write_bytes(DAMAGE[damage](path.read_bytes()))
    assert store.read(key(7)) is None
    assert not path.exists() and store.counters.bad_files == 1
    store.close()


def test_other_models_and_other_keys_are_misses(tmp_path: Path) -> None:
    other = BlockStore(tmp_path, bytes(16), BLOCK_BYTES)
    other.write(key(3), payload(3), "chat")
    store = BlockStore(tmp_path, FINGERPRINT, BLOCK_BYTES)
    assert store.read(key(3)) is None  # written for another model fingerprint
    store.write(key(4), payload(4), "chat")
    os.replace(store.path(key(4)), store.path(key(5)))  # a file under the wrong name
    assert store.read(key(5)) is None
    assert store.counters.bad_files == 2
    other.close()
    store.close()


# ---- concurrent writers in separate processes ---------------------------------------------

N_KEYS = 24
ROUNDS = 6


def _writer(root: str, writer: int, rounds: int) -> None:
    store = BlockStore(root, FINGERPRINT, 256 * 1024)
    for r in range(rounds):
        for i in range(N_KEYS):
            store.path(key(i)).unlink(missing_ok=True)  # force a real rewrite every round
            store.write(key(i), payload(1000 * writer + i, 256 * 1024), "chat")
        del r
    store.close()


def test_concurrent_writers_never_expose_a_torn_block(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    writers = [ctx.Process(target=_writer, args=(str(tmp_path), w, ROUNDS)) for w in (1, 2)]
    for p in writers:
        p.start()
    store = BlockStore(tmp_path, FINGERPRINT, 256 * 1024)
    valid = {i: [payload(1000 * w + i, 256 * 1024) for w in (1, 2)] for i in range(N_KEYS)}
    reads = 0
    while any(p.is_alive() for p in writers) or reads == 0:
        for i in range(N_KEYS):
            got = store.read(key(i))
            if got is not None:
                reads += 1
                assert any(torch.equal(got, v) for v in valid[i]), "a torn or mixed block was read"
    for p in writers:
        p.join()
        assert p.exitcode == 0
    assert reads > 0 and store.counters.bad_files == 0
    store.close()


# ---- a full disk and an unwritable directory ------------------------------------------------


def test_full_disk_skips_writes_and_logs_once(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", "size=64k") as root:
        store = BlockStore(root, FINGERPRINT, BLOCK_BYTES, retry_writes_after_s=0)
        with capture_logs() as logs:
            written = [store.write(key(i), payload(i), "chat") for i in range(40)]
        assert any(written) and not all(written)
        failures = [e for e in logs if e["event"] == "kv_store_write_failed"]
        assert len(failures) == 1 and "No space left" in failures[0]["error"]
        assert not list(root.rglob("*.tmp.*"))  # no half-written leftovers
        assert all(
            torch.equal(store.read(key(i)), payload(i)) for i, ok in enumerate(written) if ok
        )
        store.close()


def test_unwritable_directory_skips_writes_and_logs_once(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        context = tmpfs(tmp_path / "ro", "ro,size=64k")
    else:
        (tmp_path / "ro").mkdir(mode=0o500)
        context = contextlib.nullcontext(tmp_path / "ro")
    with context as root, capture_logs() as logs:
        store = BlockStore(root / "store", FINGERPRINT, BLOCK_BYTES, retry_writes_after_s=0)
        assert not any(store.write(key(i), payload(i), "chat") for i in range(5))
        assert store.read(key(0)) is None
        store.close()
    failures = [e for e in logs if e["event"] == "kv_store_write_failed"]
    assert len(failures) == 1, logs


def test_full_disk_counts_failed_writes_and_a_sweep_that_frees_space_resumes_them(
    tmp_path: Path,
) -> None:
    from daemon.kv.store_gc import StoreSweeper
    from daemon.kv.traffic import TrafficClasses

    with tmpfs(tmp_path / "small", "size=64k") as root:
        store = BlockStore(root, FINGERPRINT, BLOCK_BYTES, retry_writes_after_s=3600)
        written = [store.write(key(i), payload(i), "chat") for i in range(40)]
        n = written.index(False)
        assert store.counters.failed_writes == 1 and not any(written[n:])
        assert store.counters.dropped_writes == 40 - n - 1  # paused after the failure
        # the sweeper frees space (room for n blocks: evict down to half): writes go on at once
        sweeper = StoreSweeper(store, TrafficClasses(), n * (HEADER_BYTES + BLOCK_BYTES), 0.5, 0.5)
        assert sweeper.sweep().evicted > 0
        assert store.write(key(100), payload(100), "chat")
        store.close()


# ---- files that must not be read whole, or at all -------------------------------------------


def test_a_file_longer_than_its_header_says_is_not_read(tmp_path: Path) -> None:
    import tracemalloc

    store = BlockStore(tmp_path, FINGERPRINT, BLOCK_BYTES)
    store.write(key(1), payload(1), "chat")
    path = store.path(key(1))
    os.truncate(path, 256 << 20)  # a valid header, then 256 MiB (sparse)
    tracemalloc.start()
    try:
        assert store.read(key(1)) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated to read a {BLOCK_BYTES}-byte block"
    assert not path.exists() and store.counters.bad_files == 1
    store.close()


def _in_thread(fn, timeout: float = 5.0):
    """fn() in a thread; AssertionError if it has not returned within `timeout`."""
    import threading

    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{fn} did not return within {timeout} s"
    return out[0]


def test_a_fifo_in_place_of_a_block_is_a_miss(tmp_path: Path) -> None:
    store = BlockStore(tmp_path, FINGERPRINT, BLOCK_BYTES)
    path = store.path(key(1))
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    try:
        assert _in_thread(lambda: store.read(key(1))) is None
        assert not path.exists() and store.counters.bad_files == 1
    finally:
        if path.exists():  # (a reader blocked in open() waits for a writer)
            with contextlib.suppress(OSError):
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    _in_thread(store.close)


async def test_reads_past_their_deadline_are_misses(tmp_path: Path) -> None:
    """Every I/O thread stuck in the file system (as on a hung network mount): a chain read
    is a miss at its deadline, and closing the store does not wait for the stuck threads."""
    import asyncio
    import threading
    import time

    store = BlockStore(tmp_path, FINGERPRINT, BLOCK_BYTES, io_threads=2, read_timeout_s=0.3)
    assert store.write(key(1), payload(1), "chat")
    hung = threading.Event()
    for _ in range(2):
        store.pool.submit(hung.wait)
    try:
        start = time.monotonic()
        with capture_logs() as logs:
            found = await asyncio.wait_for(store.load_chain([key(1), key(2)]), 5)
        assert found == [] and time.monotonic() - start < 2
        assert store.counters.read_timeouts == 2
        assert [e["event"] for e in logs] == ["kv_store_read_timed_out"]
        with capture_logs() as logs:
            await asyncio.wait_for(asyncio.to_thread(store.close), 5)
        assert [e["event"] for e in logs] == ["kv_store_io_stuck"]
    finally:
        hung.set()


async def test_stopping_the_engine_keeps_the_loop_running_past_stuck_io_threads(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Closing the store waits up to `read_timeout_s` for I/O threads stuck in the file system:
    off the event loop, which meanwhile goes on serving (other requests, the admin socket)."""
    import asyncio
    import threading
    import time

    from daemon.build.config import EngineConfig
    from daemon.build.engine import build_engine

    cfg = EngineConfig(
        model=str(tiny_model_dir), kv_cache_memory_gb=0.02, kv_store_dir=str(tmp_path / "store")
    )
    engine, _ = build_engine(cfg)
    store = engine.scheduler.prefix.store
    store.read_timeout_s = 1.0
    await engine.start()
    hung = threading.Event()
    for _ in range(64):  # more than it has threads: every one stuck
        store.pool.submit(hung.wait)
    gaps: list[float] = []

    async def tick() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    try:
        with capture_logs() as logs:
            start = time.monotonic()
            await asyncio.wait_for(engine.stop(), 10)
        assert time.monotonic() - start >= 0.9  # it did wait for the stuck threads
        assert "kv_store_io_stuck" in [e["event"] for e in logs]
        assert len(gaps) > 20 and max(gaps) < 0.5, f"the event loop stood still: {gaps}"
    finally:
        ticker.cancel()
        hung.set()


def test_writes_run_on_their_own_threads_in_the_background(tmp_path: Path) -> None:
    """A prefill's burst of block writes must not take the cores from the forward's threads:
    they go to a quarter of the I/O threads, under SCHED_IDLE on Linux (reads keep them all,
    at the process's own priority)."""
    import sys
    import threading

    store = BlockStore(tmp_path, FINGERPRINT, BLOCK_BYTES, io_threads=8)
    try:
        assert len(store.writer._threads) == 2 and len(store.pool._threads) == 8

        def policy() -> tuple[str, int, int]:
            tid = threading.get_native_id()
            return (
                threading.current_thread().name,
                os.sched_getscheduler(0),
                os.getpriority(os.PRIO_PROCESS, tid),
            )

        base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        name, sched, _ = store.writer.submit(policy).result(5)
        assert name.startswith("kvstore-write")
        if sys.platform.startswith("linux"):
            assert sched == os.SCHED_IDLE
        _, sched, nice = store.pool.submit(policy).result(5)
        assert sched == os.sched_getscheduler(0) and nice == base
        store.submit_write(key(3), payload(3), "chat")
        for future in list(store._pending):
            assert future.result(5) is True
        assert store.read(key(3)) is not None
    finally:
        store.close()


async def test_a_write_waited_on_leaves_the_background_writers(tmp_path: Path) -> None:
    """A store-path handoff waits on its blocks' writes: one still queued behind busy (or, on
    a node whose forward takes every core, starved) background writers moves to the I/O pool
    and is published within the wait."""
    import threading

    store = BlockStore(tmp_path, FINGERPRINT, BLOCK_BYTES, io_threads=8)
    release = threading.Event()
    try:
        busy = [store.writer.submit(release.wait, 30) for _ in store.writer._threads]
        store.submit_write(key(5), payload(5), "chat")
        assert await store.published([key(5)], 5.0) == 1
        assert store.read(key(5)) is not None
        assert not any(f.done() for f in busy)  # the background writers never ran it
        assert not store._pending and not store._queued
    finally:
        release.set()
        store.close()


async def test_a_block_still_being_written_is_read_from_its_payload(tmp_path: Path) -> None:
    """A block whose write waits behind busy (or starved) background writers is a hit, from the
    payload the write holds; the file comes once the write runs."""
    store = BlockStore(tmp_path, FINGERPRINT, BLOCK_BYTES, io_threads=4, write_threads=1)
    gate = threading.Event()
    try:
        store.writer.submit(gate.wait, 10)
        store.submit_write(key(7), payload(7), "chat")
        found = await store.load_chain([key(7), key(8)])
        assert len(found) == 1 and torch.equal(found[0], payload(7))
        assert not store.path(key(7)).exists() and store.counters.hits == 1
        gate.set()
        await store.flush()
        assert store.path(key(7)).exists() and torch.equal(store.read(key(7)), payload(7))
    finally:
        gate.set()
        store.close()


async def test_a_block_counts_as_published_only_once_its_write_is(tmp_path: Path) -> None:
    """What a prefill node may name to a decode node: the leading blocks whose files are
    published, their writes waited for within the bound and no longer."""
    store = BlockStore(tmp_path, FINGERPRINT, BLOCK_BYTES, io_threads=1, write_threads=1)
    gate = threading.Event()
    # both threads busy: the writes queue behind them, moved to the I/O pool or not
    store.writer.submit(gate.wait, 10)
    store.pool.submit(gate.wait, 10)
    for i in range(3):
        store.submit_write(key(i), payload(i), "chat")
    keys = [key(i) for i in range(3)]
    assert await store.published(keys, 0.05) == 0  # queued, not written: not claimed
    gate.set()
    assert await store.published(keys, 5.0) == 3
    store.path(key(1)).unlink()
    assert await store.published(keys, 5.0) == 1  # leading ones only
    store.path(key(0)).write_bytes(b"short")
    assert await store.published(keys, 5.0) == 0  # not a whole block
    store.close()


def test_daemons_sharing_a_store_read_the_same_identity(tmp_path: Path) -> None:
    one, two = (BlockStore(tmp_path, FINGERPRINT, BLOCK_BYTES) for _ in range(2))
    assert one.identity and one.identity == two.identity
    other = BlockStore(tmp_path / "other", FINGERPRINT, BLOCK_BYTES)
    assert other.identity and other.identity != one.identity
    assert not list(tmp_path.rglob("*.tmp.*"))
    for store in (one, two, other):
        store.close()

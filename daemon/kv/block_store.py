"""Block store: prefix blocks as files in a directory of a shared POSIX file system (a 3FS
FUSE mount in production, a local directory by default), shared by every daemon using it.

Writes publish atomically (temporary name, optional fsync, rename), so concurrent writers of
one block and readers never see a torn file. I/O runs on bounded thread pools, writes on a
few threads of lower priority of their own; reads of a chain go out in growing batches
(prefetching the blocks after the first) and stop at a miss.
A read that has not returned by its deadline (a hung network file system) is a miss too.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import stat
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import structlog
import torch

from daemon.kv.io_pool import IoPool
from daemon.kv.store_format import HEADER_BYTES, VERSION, BadBlockFile, encode_header, verify

log = structlog.get_logger(__name__)

SUFFIX = ".kvb"
TMP_MARK = ".tmp."
# names the store (a random id, made by its first user): daemons that read the same id share
# one store, whatever path each mounts it at
IDENTITY_FILE = "store-id"
LOOK_S = 0.05  # the least time `published` gives its look at the files


@dataclass
class StoreCounters:
    lookups: int = 0
    hits: int = 0
    bytes_read: int = 0
    writes: int = 0
    bytes_written: int = 0
    already_stored: int = 0  # another writer had published the block first
    dropped_writes: int = 0  # the write queue was full or writes are paused after an error
    failed_writes: int = 0  # the file system refused a write (full, read-only, ...)
    failed_reads: int = 0  # an I/O error other than a missing file
    read_timeouts: int = 0  # reads past their deadline (counted as misses)
    bad_files: int = 0


@dataclass
class StoreUsage:
    """What the store holds: counted by each sweep, kept current by this daemon's writes and
    removals in between (other daemons' show at the next sweep)."""

    files: int = 0
    bytes: int = 0


class BlockStore:
    def __init__(
        self,
        root: str | Path,
        fingerprint: bytes,
        block_bytes: int,
        *,
        fsync: bool = False,
        io_threads: int = 8,
        write_threads: int | None = None,
        max_prefetch: int = 16,
        max_pending_writes: int = 1024,
        touch_interval_s: float = 3600.0,
        retry_writes_after_s: float = 60.0,
        read_timeout_s: float = 10.0,
        flush_timeout_s: float = 60.0,
    ) -> None:
        self.dir = Path(root) / f"v{VERSION}"
        self.fingerprint, self.block_bytes = fingerprint, block_bytes
        self.fsync = fsync
        self.max_prefetch, self.max_pending_writes = max_prefetch, max_pending_writes
        self.touch_interval_s, self.retry_writes_after_s = touch_interval_s, retry_writes_after_s
        self.read_timeout_s, self.flush_timeout_s = read_timeout_s, flush_timeout_s
        self.pool = IoPool(io_threads, "kvstore")  # reads (a request waits), touches, sweeps
        # writes: a quarter of the threads (None), in the background, so that a burst of them
        # (a prefill's blocks) does not take cores from the forward's threads; no request waits
        # on one (a store-path handoff waits a while, then sends the blocks itself)
        writers = max(1, io_threads // 4) if write_threads is None else write_threads
        self.writer = IoPool(writers, "kvstore-write", background=True)
        self.counters = StoreCounters()
        self.usage: StoreUsage | None = None  # unknown until the first sweep
        self._pending: set[Future[bool]] = set()
        self._pending_by_key: dict[bytes, Future[bool]] = {}  # each key's last write
        self._queued: dict[Future[bool], tuple[bytes, torch.Tensor, str]] = {}  # their jobs
        self._reading: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._writes_paused_until = 0.0
        self._logged: set[str] = set()
        self.identity: str | None = None  # None: the store could not be named (unwritable)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._write_failed(e)
        else:
            try:
                self.identity = self._identity()
            except OSError as e:
                self._log_once("kv_store_unnamed", e)

    def _identity(self) -> str:
        """The store's id, made once by whoever comes first (linked into place: no reader
        sees a torn one, no two writers both win)."""
        path = self.dir / IDENTITY_FILE
        if not path.exists():
            tmp = path.with_name(f"{IDENTITY_FILE}{TMP_MARK}{os.getpid()}.{uuid.uuid4().hex[:8]}")
            tmp.write_text(uuid.uuid4().hex)
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass  # another daemon named it first
            finally:
                tmp.unlink()
        with open_regular(path) as f:
            return f.read(64).decode("ascii", "replace").strip()

    def path(self, key: bytes) -> Path:
        name = key.hex()
        return self.dir / name[:2] / name[2:4] / (name + SUFFIX)

    # ---- blocking I/O (store threads) ----------------------------------------------------

    def read(self, key: bytes) -> torch.Tensor | None:
        """The block's payload (uint8, CPU), or None: missing, unreadable or untrustworthy. A
        block whose write is still queued or running comes from that write's payload (the
        background writers may not have run yet on a node whose forward keeps the cores)."""
        pending = self._pending_payload(key)
        if pending is not None:
            with self._lock:
                self.counters.hits += 1
            return pending.clone()
        path = self.path(key)
        size = HEADER_BYTES + self.block_bytes
        with self._mark_reading(str(path)):
            try:
                with open_regular(path) as f:
                    st = os.fstat(f.fileno())
                    if st.st_size != size:  # checked before reading: it may be huge
                        self._remove_bad(path, st.st_ino, f"{st.st_size} bytes, expected {size}")
                        return None
                    raw = bytearray(size)
                    n = f.readinto(raw)
            except FileNotFoundError:
                return None
            except NotRegularFile as e:
                self._remove_bad(path, e.inode, "not a regular file")
                return None
            except OSError as e:
                self._count("failed_reads")
                self._log_once("kv_store_read_failed", e)
                return None
            try:
                payload = verify(memoryview(raw)[:n], self.fingerprint, key, self.block_bytes)
            except BadBlockFile as e:
                self._remove_bad(path, st.st_ino, str(e))
                return None
        if time.time() - st.st_mtime > self.touch_interval_s:
            with contextlib.suppress(OSError):
                os.utime(path)  # the file's mtime is its last use, for retention
        with self._lock:
            self.counters.hits += 1
            self.counters.bytes_read += n
        return torch.frombuffer(raw, dtype=torch.uint8, offset=len(raw) - payload.nbytes)

    def write(self, key: bytes, payload: torch.Tensor, traffic_class: str) -> bool:
        if time.monotonic() < self._writes_paused_until:
            self._count("dropped_writes")
            return False
        path = self.path(key)
        if path.exists():
            self._count("already_stored")
            return False
        data = memoryview(payload.numpy())
        tmp = path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}.{uuid.uuid4().hex[:8]}")
        header = encode_header(self.fingerprint, key, data, traffic_class, time.time())
        try:
            self._write_file(tmp, header, data)
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            self._write_failed(e)
            return False
        with self._lock:
            self.counters.writes += 1
            self.counters.bytes_written += data.nbytes
            if self.usage is not None:
                self.usage.files += 1
                self.usage.bytes += len(header) + data.nbytes
        self.resume_writes()
        return True

    def resume_writes(self) -> None:
        """Writes go on now (a write went through, or a sweep freed space); a new failure is
        logged again."""
        with self._lock:
            if not self._writes_paused_until:
                return
            self._writes_paused_until = 0.0
            self._logged = {e for e in self._logged if not e.startswith("kv_store_write_failed")}
        log.info("kv_store_writes_resumed", dir=str(self.dir))

    def set_usage(self, files: int, nbytes: int) -> None:
        with self._lock:
            self.usage = StoreUsage(files, nbytes)

    def removed(self, nbytes: int) -> None:
        """A file of the store was deleted (by the sweeper or a bad read)."""
        with self._lock:
            if self.usage is not None:
                self.usage.files = max(0, self.usage.files - 1)
                self.usage.bytes = max(0, self.usage.bytes - nbytes)

    def _write_file(self, path: Path, header: bytes, data: memoryview) -> None:
        """One open and one writev (the fan-out directories are made on first need)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o644)
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, flags, 0o644)
        try:
            written = os.writev(fd, [header, data])
            if written != len(header) + data.nbytes:  # a short write: the disk filled up
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def touch(self, keys: list[bytes]) -> None:
        """Mark blocks used (their retention restarts) without reading them."""
        for key in keys:
            with contextlib.suppress(OSError):
                os.utime(self.path(key))

    def count_published(self, keys: list[bytes]) -> int:
        """How many leading `keys` have a published file of a block's size (its content is
        checked by whoever reads it)."""
        size = HEADER_BYTES + self.block_bytes
        for n, key in enumerate(keys):
            try:
                st = os.stat(self.path(key))
            except OSError:
                return n
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                return n
        return len(keys)

    def is_reading(self, path: str) -> bool:
        with self._lock:
            return self._reading[path] > 0

    # ---- event loop ------------------------------------------------------------------------

    async def load_chain(self, keys: list[bytes]) -> list[torch.Tensor]:
        """Payloads of the leading blocks of `keys` found in the store, in order; the chain
        ends at the first miss, or at what has not come back within `read_timeout_s`."""
        loop = asyncio.get_running_loop()
        found: list[torch.Tensor] = []
        batch = 2
        deadline = loop.time() + self.read_timeout_s
        while len(found) < len(keys):
            start = len(found)
            wanted = keys[start : start + batch]
            self.counters.lookups += len(wanted)
            reads = [loop.run_in_executor(self.pool, self.read, key) for key in wanted]
            done, late = await asyncio.wait(reads, timeout=max(0.0, deadline - loop.time()))
            for future in late:
                future.cancel()  # one not started yet never runs; a running one is left behind
            if late:
                self.counters.read_timeouts += len(late)
                self._log_once(
                    "kv_store_read_timed_out",
                    TimeoutError(f"no answer within {self.read_timeout_s} s"),
                )
            results = [f.result() if f in done else None for f in reads]
            for payload in results:
                if payload is None:
                    return found
                found.append(payload)
            batch = min(2 * batch, self.max_prefetch)
        return found

    def submit_write(self, key: bytes, payload: torch.Tensor, traffic_class: str) -> None:
        if len(self._pending) >= self.max_pending_writes:
            self.counters.dropped_writes += 1
            return
        self._track(
            self.writer.submit(self.write, key, payload, traffic_class), key, payload, traffic_class
        )

    def _track(self, future: Future[bool], key: bytes, payload: torch.Tensor, cls: str) -> None:
        with self._lock:
            self._pending.add(future)
            self._pending_by_key[key] = future
            self._queued[future] = (key, payload, cls)
        future.add_done_callback(lambda f: self._written(key, f))

    def _written(self, key: bytes, future: Future[bool]) -> None:
        with self._lock:
            self._pending.discard(future)
            self._queued.pop(future, None)
            if self._pending_by_key.get(key) is future:
                del self._pending_by_key[key]

    def _pending_payload(self, key: bytes) -> torch.Tensor | None:
        """The payload of `key`'s write not yet done (None: none pending, or not a block's)."""
        with self._lock:
            future = self._pending_by_key.get(key)
            job = self._queued.get(future) if future is not None else None
        if job is None or job[1].numel() != self.block_bytes:
            return None
        return job[1]

    def _hurry(self, futures: list[Future[bool]]) -> list[Future[bool]]:
        """Writes that someone now waits on: those not started yet move from the background
        writers to the I/O pool, at the process's own priority (on a node whose forward keeps
        every core busy, a background thread may not run for a long while)."""
        hurried = []
        for future in futures:
            with self._lock:
                job = self._queued.get(future)
            # cancel() runs the done callbacks here, which take the lock: not held now
            if job is not None and not self.pool.closed and future.cancel():
                key, payload, cls = job
                future = self.pool.submit(self.write, key, payload, cls)
                self._track(future, key, payload, cls)
            hurried.append(future)
        return hurried

    async def published(self, keys: list[bytes], timeout_s: float) -> int:
        """How many leading `keys` are published in the store: the writes submitted for them
        waited for (moved out of the background first, `_hurry`), then their files looked at;
        what is not known within `timeout_s` (a hung file system) is not published."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        with self._lock:
            queued = [f for k in keys if (f := self._pending_by_key.get(k))]
        writes = [asyncio.wrap_future(f) for f in self._hurry(queued)]
        if writes:
            await asyncio.wait(writes, timeout=timeout_s)
        look = loop.run_in_executor(self.pool, self.count_published, keys)
        # the look itself gets a moment even when the writes took all of `timeout_s`
        done, _ = await asyncio.wait([look], timeout=max(LOOK_S, deadline - loop.time()))
        return look.result() if done else 0

    def submit_touch(self, keys: list[bytes]) -> None:
        self.pool.submit(self.touch, keys)

    async def flush(self) -> None:
        """Wait for every write submitted so far, `flush_timeout_s` at most."""
        pending = [asyncio.wrap_future(f) for f in list(self._pending)]
        if not pending:
            return
        _, late = await asyncio.wait(pending, timeout=self.flush_timeout_s)
        if late:
            log.warning(
                "kv_store_flush_timed_out", dir=str(self.dir), unwritten=len(late),
                timeout_s=self.flush_timeout_s,
            )  # fmt: skip

    def close(self) -> None:
        """Stops the I/O threads; one stuck in the file system is left behind (and logged)."""
        deadline = time.monotonic() + self.read_timeout_s
        stuck = self.pool.shutdown(wait=True, cancel_futures=True, timeout=self.read_timeout_s)
        left = max(0.0, deadline - time.monotonic())
        stuck += self.writer.shutdown(wait=True, cancel_futures=True, timeout=left)
        if stuck:
            log.warning("kv_store_io_stuck", dir=str(self.dir), threads=len(stuck))

    # ---- helpers -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _mark_reading(self, path: str):
        with self._lock:
            self._reading[path] += 1
        try:
            yield
        finally:
            with self._lock:
                self._reading[path] -= 1
                if not self._reading[path]:
                    del self._reading[path]

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self.counters, name, getattr(self.counters, name) + 1)

    def _remove_bad(self, path: Path, inode: int, reason: str) -> None:
        self._count("bad_files")
        log.warning("kv_store_bad_block", path=str(path), reason=reason)
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if st.st_ino == inode:  # not a good copy another writer just published
                os.unlink(path)
                self.removed(st.st_size if stat.S_ISREG(st.st_mode) else 0)

    def _write_failed(self, e: OSError) -> None:
        """A full disk or an unwritable directory: pause writes a while, say so once."""
        with self._lock:
            self.counters.failed_writes += 1
            self._writes_paused_until = time.monotonic() + self.retry_writes_after_s
        kind = errno.errorcode.get(e.errno or 0, "OSError")
        self._log_once(f"kv_store_write_failed:{kind}", e, paused_s=self.retry_writes_after_s)

    def _log_once(self, event: str, e: Exception, **extra: object) -> None:
        with self._lock:
            if event in self._logged:
                return
            self._logged.add(event)
        log.warning(event.split(":")[0], dir=str(self.dir), error=str(e), **extra)


class NotRegularFile(OSError):
    """A FIFO, device or directory where a block file should be."""

    def __init__(self, path: str | Path, inode: int) -> None:
        super().__init__(errno.EINVAL, "not a regular file", str(path))
        self.inode = inode


def open_regular(path: str | Path) -> BinaryIO:
    """`path` opened for reading, unbuffered, or NotRegularFile: opened non-blocking, so that a
    FIFO put there does not wait for a writer that never comes."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotRegularFile(path, st.st_ino)
    return os.fdopen(fd, "rb", buffering=0)

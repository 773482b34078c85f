"""Block store: prefix blocks as files in a directory of a shared POSIX file system (a 3FS
FUSE mount in production, a local directory by default), shared by every daemon using it.

Writes publish atomically (temporary name, optional fsync, rename), so concurrent writers of
one block and readers never see a torn file. I/O runs on a bounded thread pool; reads of a
chain go out in growing batches (prefetching the blocks after the first) and stop at a miss.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from daemon.kv.store_format import VERSION, BadBlockFile, encode_header, verify

log = structlog.get_logger(__name__)

SUFFIX = ".kvb"
TMP_MARK = ".tmp."


@dataclass
class StoreCounters:
    lookups: int = 0
    hits: int = 0
    bytes_read: int = 0
    writes: int = 0
    bytes_written: int = 0
    already_stored: int = 0  # another writer had published the block first
    dropped_writes: int = 0  # the write queue was full or writes are paused after an error
    bad_files: int = 0


class BlockStore:
    def __init__(
        self,
        root: str | Path,
        fingerprint: bytes,
        block_bytes: int,
        *,
        fsync: bool = False,
        io_threads: int = 8,
        max_prefetch: int = 16,
        max_pending_writes: int = 1024,
        touch_interval_s: float = 3600.0,
        retry_writes_after_s: float = 60.0,
    ) -> None:
        self.dir = Path(root) / f"v{VERSION}"
        self.fingerprint, self.block_bytes = fingerprint, block_bytes
        self.fsync = fsync
        self.max_prefetch, self.max_pending_writes = max_prefetch, max_pending_writes
        self.touch_interval_s, self.retry_writes_after_s = touch_interval_s, retry_writes_after_s
        self.pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvstore")
        self.counters = StoreCounters()
        self._pending: set[Future[bool]] = set()
        self._reading: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._writes_paused_until = 0.0
        self._logged: set[str] = set()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._write_failed(e)

    def path(self, key: bytes) -> Path:
        name = key.hex()
        return self.dir / name[:2] / name[2:4] / (name + SUFFIX)

    # ---- blocking I/O (store threads) ----------------------------------------------------

    def read(self, key: bytes) -> torch.Tensor | None:
        """The block's payload (uint8, CPU), or None: missing, unreadable or untrustworthy."""
        path = self.path(key)
        with self._mark_reading(str(path)):
            try:
                with open(path, "rb", buffering=0) as f:
                    stat = os.fstat(f.fileno())
                    raw = bytearray(stat.st_size)
                    n = f.readinto(raw)
            except FileNotFoundError:
                return None
            except OSError as e:
                self._log_once("kv_store_read_failed", e)
                return None
            try:
                payload = verify(memoryview(raw)[:n], self.fingerprint, key, self.block_bytes)
            except BadBlockFile as e:
                self._remove_bad(path, stat.st_ino, str(e))
                return None
        if time.time() - stat.st_mtime > self.touch_interval_s:
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
            if self._writes_paused_until:
                self._writes_paused_until = 0.0
                log.info("kv_store_writes_resumed", dir=str(self.dir))
        return True

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

    def is_reading(self, path: str) -> bool:
        with self._lock:
            return self._reading[path] > 0

    # ---- event loop ------------------------------------------------------------------------

    async def load_chain(self, keys: list[bytes]) -> list[torch.Tensor]:
        """Payloads of the leading blocks of `keys` found in the store, in order."""
        loop = asyncio.get_running_loop()
        found: list[torch.Tensor] = []
        batch = 2
        while len(found) < len(keys):
            start = len(found)
            wanted = keys[start : start + batch]
            self.counters.lookups += len(wanted)
            results = await asyncio.gather(
                *(loop.run_in_executor(self.pool, self.read, key) for key in wanted)
            )
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
        future = self.pool.submit(self.write, key, payload, traffic_class)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)

    def submit_touch(self, keys: list[bytes]) -> None:
        self.pool.submit(self.touch, keys)

    async def flush(self) -> None:
        """Wait for every write submitted so far."""
        pending = [asyncio.wrap_future(f) for f in list(self._pending)]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    def close(self) -> None:
        self.pool.shutdown(wait=True)

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
            if os.stat(path).st_ino == inode:  # not a good copy another writer just published
                os.unlink(path)

    def _write_failed(self, e: OSError) -> None:
        """A full disk or an unwritable directory: pause writes a while, say so once."""
        with self._lock:
            self._writes_paused_until = time.monotonic() + self.retry_writes_after_s
        kind = errno.errorcode.get(e.errno or 0, "OSError")
        self._log_once(f"kv_store_write_failed:{kind}", e, paused_s=self.retry_writes_after_s)

    def _log_once(self, event: str, e: OSError, **extra: object) -> None:
        with self._lock:
            if event in self._logged:
                return
            self._logged.add(event)
        log.warning(event.split(":")[0], dir=str(self.dir), error=str(e), **extra)

"""Block-store garbage collection: drop blocks past their class's retention, then, above the
high watermark, the blocks closest to expiry (oldest use, shorter-lived class first) down to
the low watermark. A file's mtime is its last use; a block being read is never deleted."""

from __future__ import annotations

import contextlib
import math
import os
import stat
import time
from dataclasses import dataclass

import structlog

from daemon.kv.block_store import SUFFIX, TMP_MARK, BlockStore, open_regular
from daemon.kv.store_format import HEADER_BYTES, BadBlockFile, decode_header
from daemon.kv.traffic import TrafficClasses

log = structlog.get_logger(__name__)

STALE_TMP_S = 3600.0  # a temporary file this old belongs to a writer that died


@dataclass
class SweepResult:
    files: int = 0
    bytes: int = 0  # what is left
    expired: int = 0
    evicted: int = 0
    freed_bytes: int = 0
    skipped_in_use: int = 0


@dataclass
class _Block:
    expires: float
    path: str
    inode: int
    mtime_ns: int
    size: int


class StoreSweeper:
    def __init__(
        self,
        store: BlockStore,
        classes: TrafficClasses,
        capacity_bytes: int,
        high_watermark: float = 0.9,
        low_watermark: float = 0.8,
    ) -> None:
        if not 0 < low_watermark <= high_watermark <= 1:
            raise ValueError("store watermarks need 0 < low <= high <= 1")
        self.store, self.classes = store, classes
        self.capacity_bytes = capacity_bytes
        self.high, self.low = high_watermark, low_watermark
        self._class_of: dict[int, str] = {}  # inode -> traffic class (a file never changes class)

    def sweep(self, now: float | None = None) -> SweepResult:
        now = time.time() if now is None else now
        result = SweepResult()
        blocks = self._scan(now)
        keep: list[_Block] = []
        for block in blocks:
            if block.expires <= now and self._remove(block, result):
                result.expired += 1
                continue
            keep.append(block)
        total = sum(b.size for b in keep)
        if self.capacity_bytes and total > self.high * self.capacity_bytes:
            keep.sort(key=lambda b: b.expires)
            survivors = []
            for i, block in enumerate(keep):
                if total <= self.low * self.capacity_bytes:
                    survivors.extend(keep[i:])
                    break
                if self._remove(block, result):
                    result.evicted += 1
                    total -= block.size
                else:
                    survivors.append(block)
            keep = survivors
        result.files, result.bytes = len(keep), sum(b.size for b in keep)
        self.store.set_usage(result.files, result.bytes)
        if result.freed_bytes:
            self.store.resume_writes()  # a write that failed for lack of space may fit now
        if result.expired or result.evicted:
            log.info("kv_store_swept", **vars(result))
        return result

    def _scan(self, now: float) -> list[_Block]:
        blocks: list[_Block] = []
        seen: set[int] = set()
        for dirpath, _, names in os.walk(self.store.dir):
            for name in names:
                path = os.path.join(dirpath, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue  # removed meanwhile
                if TMP_MARK in name:
                    if now - st.st_mtime > STALE_TMP_S:
                        with contextlib.suppress(OSError):
                            os.unlink(path)
                    continue
                if not name.endswith(SUFFIX):
                    continue
                # a FIFO, link, directory or unreadable file in the store is garbage: it has
                # already expired, whatever its mtime (which may be later than `now`)
                regular = stat.S_ISREG(st.st_mode)
                cls = self._traffic_class(path, st.st_ino) if regular else None
                seen.add(st.st_ino)
                expires = st.st_mtime + self.classes.retention(cls) if cls else -math.inf
                blocks.append(_Block(expires, path, st.st_ino, st.st_mtime_ns, st.st_size))
        self._class_of = {i: c for i, c in self._class_of.items() if i in seen}
        return blocks

    def _traffic_class(self, path: str, inode: int) -> str | None:
        """None for a file whose header is unreadable: it is garbage and expires now."""
        cls = self._class_of.get(inode)
        if cls is None:
            try:
                with open_regular(path) as f:
                    cls = decode_header(f.read(HEADER_BYTES)).traffic_class
            except (OSError, BadBlockFile):
                return None
            self._class_of[inode] = cls
        return cls

    def _remove(self, block: _Block, result: SweepResult) -> bool:
        if self.store.is_reading(block.path):
            result.skipped_in_use += 1
            return False
        try:
            st = os.lstat(block.path)
            if st.st_ino != block.inode or st.st_mtime_ns != block.mtime_ns:
                return False  # used or replaced since the scan
            os.unlink(block.path)
        except OSError:
            return False
        result.freed_bytes += block.size
        return True

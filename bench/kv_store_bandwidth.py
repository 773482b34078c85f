"""Block-store write and cold-read bandwidth vs the same disk's raw sequential bandwidth (dd),
measured in one run, with one DeepSeek-V4-Flash prefix block (bf16, 128 tokens) per file.

    python -m bench.kv_store_bandwidth [--total-gib 1 --repeats 3 --dir DIR --block-mib 1.19]

Writes: store blocks go through `submit_write` on the store's thread pool (concurrent), timed
until `flush()` returns; dd writes one file of the same size sequentially. Reads: page cache
dropped first; store blocks come back through `load_chain` (header and crc32 verified).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from bench.common import median, quiet_logs
from daemon.kv.store_format import HEADER_BYTES

MB = 1e6
MiB = 2**20
RAW_BS = MiB  # dd block size for the raw sequential figures


def flash_block_bytes() -> int:
    """Payload of one V4-Flash prefix block: its block in every paged KV group (bf16)."""
    from bench.v4_kv_bytes import FLASH, default_layer_types
    from daemon.models.deepseek_v4.config import V4Config
    from daemon.models.deepseek_v4.kv import kv_groups

    hf = dict(FLASH, layer_types=default_layer_types(FLASH["num_hidden_layers"]))
    paged = [
        g.spec for g in kv_groups(V4Config.from_hf(hf), torch.bfloat16) if not g.spec.per_request
    ]
    assert len({s.block_size for s in paged}) == 1
    return sum(s.bytes_per_block for s in paged)


# ---- cache control ----------------------------------------------------------------------------


def drop_page_cache(files: Callable[[], list[Path]]) -> str:
    """Write back dirty data, then evict cached pages; returns how (for the printed note)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        pass
    if not hasattr(os, "posix_fadvise"):
        return "none (reads may be warm)"
    for path in files():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "posix_fadvise(DONTNEED) per file (dentries/inodes stay cached)"


# ---- raw sequential I/O --------------------------------------------------------------------------


def raw_write(path: Path, nbytes: int, fdatasync: bool) -> float:
    """Seconds to write `nbytes` sequentially (dd, else Python), fdatasync'd once at the end."""
    count = nbytes // RAW_BS
    t = time.perf_counter()
    if shutil.which("dd"):
        conv = ["conv=fdatasync"] if fdatasync else []
        cmd = ["dd", "if=/dev/zero", f"of={path}", f"bs={RAW_BS}", f"count={count}", *conv]
        subprocess.run(cmd, check=True, capture_output=True)
    else:
        chunk = bytes(RAW_BS)
        with open(path, "wb", buffering=0) as f:
            for _ in range(count):
                f.write(chunk)
            if fdatasync:
                os.fdatasync(f.fileno())
    return time.perf_counter() - t


def raw_read(path: Path) -> float:
    t = time.perf_counter()
    if shutil.which("dd"):
        subprocess.run(
            ["dd", f"if={path}", "of=/dev/null", f"bs={RAW_BS}"], check=True, capture_output=True
        )
    else:
        buf = bytearray(RAW_BS)
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t


@dataclass
class PlainFiles:
    """The store's I/O shape without the store: one file per block in a flat directory, written
    and read whole on a pool of the same size; no header, checksum, temp name or fan-out."""

    root: Path
    n: int
    io_threads: int

    def files(self) -> list[Path]:
        return [self.root / f"{i}.bin" for i in range(self.n)] if self.root.exists() else []

    def _write(self, path: Path, payload: torch.Tensor, fsync: bool) -> None:
        with open(path, "wb", buffering=0) as f:
            f.write(memoryview(payload.numpy()))
            if fsync:
                os.fsync(f.fileno())

    @staticmethod
    def _read(path: Path) -> bytearray:
        with open(path, "rb", buffering=0) as f:
            raw = bytearray(os.fstat(f.fileno()).st_size)
            f.readinto(raw)
        return raw

    async def write(self, payloads: list[torch.Tensor], fsync: bool) -> float:
        self.root.mkdir(parents=True, exist_ok=True)
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(self.io_threads) as pool:
            t = time.perf_counter()
            await asyncio.gather(
                *(
                    loop.run_in_executor(
                        pool, self._write, path, payloads[i % len(payloads)], fsync
                    )
                    for i, path in enumerate(self.files())
                )
            )
            return time.perf_counter() - t

    async def read(self) -> float:
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(self.io_threads) as pool:
            t = time.perf_counter()
            got = await asyncio.gather(
                *(loop.run_in_executor(pool, self._read, path) for path in self.files())
            )
            elapsed = time.perf_counter() - t
        del got
        return elapsed


# ---- the store ---------------------------------------------------------------------------------


@dataclass
class StoreRun:
    root: Path
    block_bytes: int
    n: int
    io_threads: int
    keys: list[bytes] = field(default_factory=list)

    def open(self, fsync: bool):
        from daemon.kv.block_store import BlockStore

        return BlockStore(
            self.root,
            b"\x5a" * 16,
            self.block_bytes,
            fsync=fsync,
            io_threads=self.io_threads,
            write_threads=self.io_threads,  # as many concurrent writes as the plain files get
            max_pending_writes=self.n + 1,  # the default 1024 would drop part of 2 GiB
        )

    def files(self) -> list[Path]:
        return sorted(self.root.rglob("*.kvb"))

    def new_keys(self, fresh_dirs: bool) -> None:
        """Keys for the next write; their fan-out directories made beforehand unless
        `fresh_dirs` (a store past ~100K blocks has all 65,536 of them already)."""
        self.keys = [os.urandom(16) for _ in range(self.n)]
        if not fresh_dirs:
            store = self.open(fsync=False)
            for key in self.keys:
                store.path(key).parent.mkdir(parents=True, exist_ok=True)
            store.close()

    async def write(self, payloads: list[torch.Tensor], fsync: bool) -> float:
        store = self.open(fsync)
        t = time.perf_counter()
        for i, key in enumerate(self.keys):
            store.submit_write(key, payloads[i % len(payloads)], "chat")
        await store.flush()
        elapsed = time.perf_counter() - t
        store.close()
        if store.counters.writes != self.n:
            raise RuntimeError(
                f"{store.counters.writes} of {self.n} blocks written: {store.counters}"
            )
        return elapsed

    async def read(self, chain_blocks: int, concurrent: bool) -> float:
        """Seconds to load every block, as chains of `chain_blocks` (all at once, or one
        chain after another, as requests arriving alone would)."""
        store = self.open(fsync=False)
        chains = [self.keys[i : i + chain_blocks] for i in range(0, self.n, chain_blocks)]
        t = time.perf_counter()
        if concurrent:
            got = await asyncio.gather(*(store.load_chain(c) for c in chains))
        else:
            got = [await store.load_chain(c) for c in chains]
        elapsed = time.perf_counter() - t
        store.close()
        if sum(map(len, got)) != self.n:
            raise RuntimeError(f"read back {sum(map(len, got))} of {self.n} blocks")
        return elapsed


# ---- the run -----------------------------------------------------------------------------------

ROWS: list[tuple[str, str, str]] = [
    # (key, label, what the timed part includes); each run starts with nothing cached or dirty
    ("dd_w", "dd write, page cache", "write() of one file into the page cache; no flush"),
    ("files_w", "plain files write, fsync off", "open, write, close per block file, on the pool"),
    (
        "store_w",
        "store write, fsync off",
        "+ header, crc32, temp name, rename (fan-out dirs exist); no flush",
    ),
    ("dd_w_sync", "dd write, conv=fdatasync", "+ one fdatasync of the file at the end"),
    ("files_w_sync", "plain files write, fsync on", "+ an fsync of each file"),
    ("store_w_sync", "store write, fsync on", "+ an fsync of each file before its rename"),
    ("dd_r", "dd read, cold", "read() of one file into a reused 1 MiB buffer"),
    ("files_r", "plain files read, cold", "open, fstat, readinto a new buffer, per file"),
    ("store_r", "store read, cold, all chains at once", "+ header and crc32 check (load_chain)"),
    ("store_r1", "store read, cold, one chain at a time", "the same, one request after another"),
    ("store_r_warm", "store read, page cache (warm)", "the same, no disk: the CPU ceiling"),
]
PAIRS = [  # (store, reference)
    ("store_w", "dd_w"),
    ("store_w_sync", "dd_w_sync"),
    ("store_r", "dd_r"),
    ("store_r1", "dd_r"),
    ("store_w", "files_w"),
    ("store_w_sync", "files_w_sync"),
    ("store_r", "files_r"),
]
# measured in these groups, the order reversed every other round
GROUPS = [
    ["dd_w", "files_w", "store_w"],
    ["dd_w_sync", "files_w_sync", "store_w_sync"],
    ["dd_r", "files_r", "store_r", "store_r1"],
]


async def bench(args: argparse.Namespace) -> None:
    quiet_logs()
    block_bytes = int(args.block_mib * MiB) if args.block_mib else flash_block_bytes()
    file_bytes = block_bytes + HEADER_BYTES
    n = max(1, int(args.total_gib * 2**30) // file_bytes)
    total = n * file_bytes
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="deepinfer-kvbw-"))
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="run-", dir=root))
    raw = work / "raw.bin"
    run = StoreRun(work / "store", block_bytes, n, args.io_threads)
    plain = PlainFiles(work / "files", n, args.io_threads)
    raw_bytes = (total // RAW_BS) * RAW_BS
    gen = torch.Generator().manual_seed(0)
    payloads = [
        torch.randint(0, 256, (block_bytes,), dtype=torch.uint8, generator=gen) for _ in range(8)
    ]
    fs = os.statvfs(work)
    print(
        f"dir {work} ({fs.f_bavail * fs.f_frsize / 2**30:.0f} GiB free) | block payload "
        f"{block_bytes:,} B + header {HEADER_BYTES} B | {n} blocks = {total / 2**30:.2f} GiB | "
        f"raw file {raw_bytes / 2**30:.2f} GiB in {RAW_BS // MiB} MiB writes "
        f"({'dd' if shutil.which('dd') else 'Python, no dd'}) | store pool {args.io_threads} "
        f"threads | chains of {args.chain_blocks} blocks | fan-out dirs "
        f"{'made while writing' if args.fresh_dirs else 'made beforehand'} | {os.cpu_count()} CPUs"
    )
    secs: dict[str, list[float]] = {k: [] for k, _, _ in ROWS}
    how: set[str] = set()

    def settle() -> None:
        """The same start for every timed run: nothing dirty or cached, then a pause (this VM
        hands freed memory back to its host a moment after it is freed)."""
        how.add(drop_page_cache(lambda: [raw, *plain.files(), *run.files()]))
        time.sleep(args.settle_s)

    async def measure(key: str) -> float:
        kind, _, mode = key.partition("_")
        sync = mode == "w_sync"
        if mode.startswith("w"):
            target = {"dd": raw, "files": plain.root, "store": run.root}[kind]
            if target.is_dir():
                shutil.rmtree(target)
            target.unlink(missing_ok=True)
            if kind == "store":
                run.new_keys(args.fresh_dirs)
            settle()
            if kind == "dd":
                return raw_write(raw, raw_bytes, fdatasync=sync)
            return await (plain if kind == "files" else run).write(payloads, fsync=sync)
        if mode == "r_warm":
            await run.read(args.chain_blocks, concurrent=True)
        else:
            settle()
        if kind == "dd":
            return raw_read(raw)
        if kind == "files":
            return await plain.read()
        return await run.read(args.chain_blocks, concurrent=mode != "r1")

    try:
        rounds = args.warmup + args.repeats
        with tqdm(total=rounds * len(ROWS), desc="measurements", leave=False) as bar:
            for i in range(rounds):
                if i == args.warmup:  # warm-up rounds touch fresh memory and page cache first
                    secs = {k: [] for k in secs}
                order = [k for g in GROUPS for k in (g if i % 2 == 0 else g[::-1])]
                for key in [*order, "store_r_warm"]:
                    secs[key].append(await measure(key))
                    bar.update()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)

    size = {k: raw_bytes if k.startswith("dd") else total for k in secs}
    size |= {k: n * block_bytes for k in secs if k.startswith("files")}
    rate = {k: [size[k] / s / MB for s in v] for k, v in secs.items()}
    print(f"\ncold reads: page cache dropped by {', '.join(sorted(how))}")
    print(
        f"MB/s (1e6 B/s), median of {args.repeats}; store bytes = whole files (payload + header)\n"
    )
    width = max(len(label) for _, label, _ in ROWS)
    print(f"{'':<{width}} {'median':>8}  {'per repeat':<24}  time includes")
    for key, label, what in ROWS:
        each = " ".join(f"{r:.0f}" for r in rate[key])
        print(f"{label:<{width}} {median(rate[key]):>8.0f}  {each:<24}  {what}")
    label = {k: lbl for k, lbl, _ in ROWS}
    print(
        "\nstore / reference: ratio of the medians, and the median of the per-round ratios "
        "(each round measures both back to back)"
    )
    for store, ref in PAIRS:
        if ref == "files_w":
            print("the store's own overhead (vs the same I/O as plain files):")
        elif store == "store_w" and ref == "dd_w":
            print("vs the disk's raw sequential bandwidth (target >= 70 %):")
        paired = median([a / b for a, b in zip(rate[store], rate[ref])])
        ratio = median(rate[store]) / median(rate[ref])
        print(
            f"  {label[store]:<{width}} / {label[ref]:<29} {100 * ratio:6.1f} %  "
            f"(per round {100 * paired:.1f} %)"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", help="where to write (default: a temp dir under $TMPDIR)")
    p.add_argument("--total-gib", type=float, default=1.0, help="bytes per measurement")
    p.add_argument(
        "--block-mib", type=float, help="block payload (default: one V4-Flash block, bf16)"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument(
        "--fresh-dirs", action="store_true", help="time the fan-out mkdirs of a new store too"
    )
    p.add_argument("--settle-s", type=float, default=0.0, help="pause after each cache drop")
    p.add_argument("--io-threads", type=int, default=8, help="store pool (the daemon's default)")
    p.add_argument(
        "--chain-blocks", type=int, default=64, help="blocks per load_chain (64 = 8K tokens)"
    )
    asyncio.run(bench(p.parse_args()))


if __name__ == "__main__":
    main()

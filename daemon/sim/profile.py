"""`deepinfer profile`: the simulator's cost table measured with the real engine: its
ModelRunner's steps over synthetic batches (timed as loop/spec_profile.py times them), its
block copier's host copies, and a BlockStore's reads and writes in a temporary directory."""

from __future__ import annotations

import asyncio
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import structlog
import torch
from tqdm import tqdm

from daemon.kv.block_store import BlockStore
from daemon.kv.manager import KVManager
from daemon.kv.spec import FullAttentionSpec
from daemon.loop.engine import Engine
from daemon.loop.request import Request, SamplingParams
from daemon.loop.runner import ModelRunner
from daemon.loop.scheduler import ScheduledSeq, SchedulerStep
from daemon.loop.spec_profile import _non_decreasing, _time
from daemon.sim.table import Bandwidth, CostTable, Grid, KVGeometry, Provenance

log = structlog.get_logger(__name__)

PROFILE_ID = "sim-profile-{}"


class ProfileError(ValueError):
    """A model or grid the profile cannot measure."""


@dataclass(frozen=True)
class ProfileGrid:
    prefill_tokens: tuple[int, ...] = (32, 512, 2048)
    prefill_context: tuple[int, ...] = (0, 4096)
    decode_seqs: tuple[int, ...] = (1, 8, 32)
    decode_context: tuple[int, ...] = (256, 2048)
    # steps of k chunks of each prefill_tokens size (at context 0, those that fit the step's
    # token budget): a step's once-paid part and each chunk's own; empty: not measured
    prefill_batch: tuple[int, ...] = (1, 4)
    copy_blocks: int = 32  # blocks per host-copy and store measurement
    repeats: int = 3
    # a point's first run is a warm-up (new shapes: kernel selection, first-touched KV pages)
    # unless it took this long; the repeats stop once they have taken it
    point_seconds: float = 2.0

    def kv_tokens(self) -> int:
        """Positions the grid's largest steps hold at once."""
        decode = max(self.decode_seqs) * (max(self.decode_context) + 1)
        prefill = max(self.prefill_tokens) + max(self.prefill_context)
        batch = max(self.prefill_batch, default=1) * max(self.prefill_tokens)
        return max(decode, prefill, batch, self.copy_blocks * 512)

    def batch_tokens(self, budget: int) -> tuple[int, ...]:
        """The chunk sizes whose steps of max(prefill_batch) chunks fit `budget` tokens."""
        k = max(self.prefill_batch, default=0)
        return tuple(n for n in self.prefill_tokens if n * k <= budget) if k > 1 else ()


QUICK = ProfileGrid((8, 32), (0, 32), (1, 4), (16, 64), (1, 2), 4, 1, 0.05)


def geometry(kv: KVManager) -> KVGeometry:
    """The KV of a model whose cache is one paged full-attention group (what the simulator
    lays out); other models' cannot be simulated yet."""
    specs = [g.spec for g in kv.groups]
    if len(specs) != 1 or not isinstance(specs[0], FullAttentionSpec):
        kinds = ", ".join(type(s).__name__ for s in specs)
        raise ProfileError(
            f"the simulator models one full-attention KV group; this model has {kinds}"
        )
    s = specs[0]
    dtype = str(s.dtype).removeprefix("torch.")
    return KVGeometry(s.block_size, s.num_layers, s.num_kv_heads, s.head_dim, dtype)


def profile(engine: Engine, model: str, grid: ProfileGrid, progress: bool = True) -> CostTable:
    """Measure `grid` on the engine's runner (before it serves anything: the synthetic
    sequences take its KV blocks and give them back)."""
    runner, kv = engine.runner, engine.kv
    geo = geometry(kv)
    load = os.getloadavg()[0]
    points = [("prefill", n, c) for n in grid.prefill_tokens for c in grid.prefill_context]
    points += [("decode", s, c) for s in grid.decode_seqs for c in grid.decode_context]
    budget = engine.scheduler.max_num_batched_tokens
    batch_rows = grid.batch_tokens(budget)
    if grid.prefill_batch and len(grid.prefill_batch) > 1 and not batch_rows:
        raise ProfileError(
            f"no step of {max(grid.prefill_batch)} chunks of --prefill-tokens fits "
            f"--max-num-batched-tokens {budget}"
        )
    # one chunk at context 0 is a prefill point already: the same measurement
    reused = 0 in grid.prefill_context
    points += [
        ("batch", n, k) for n in batch_rows for k in grid.prefill_batch if k > 1 or not reused
    ]
    bar = tqdm(total=len(points) + 2, desc="profiling", unit="point", disable=not progress)
    previous_threads = torch.get_num_threads()
    if runner.cpu_threads:
        torch.set_num_threads(runner.cpu_threads)  # as the device thread runs the forward
    measured: dict[tuple[str, int, int], float] = {}
    try:
        for kind, n, c in points:
            measured[kind, n, c] = _point(runner, kv, kind, n, c, grid)
            bar.update()
        host_save, host_load = _host_copies(runner, kv, grid.copy_blocks)
        bar.update()
        store_read, store_write = _store(geo.bytes_per_block, grid.copy_blocks, grid.repeats)
        bar.update()
    finally:
        bar.close()
        torch.set_num_threads(previous_threads)
    prefill = _grid(measured, "prefill", grid.prefill_tokens, grid.prefill_context)
    decode = _grid(measured, "decode", grid.decode_seqs, grid.decode_context)
    if reused:
        measured.update({("batch", n, 1): measured["prefill", n, 0] for n in batch_rows})
    batch = _grid(measured, "batch", batch_rows, grid.prefill_batch) if batch_rows else None
    table = CostTable(
        _provenance(runner, model, geo.dtype, load),
        geo,
        prefill,
        decode,
        host_save,
        host_load,
        store_read,
        store_write,
        engine.scheduler.max_num_batched_tokens,
        engine.scheduler.max_num_seqs,
        prefill_batch=batch,
    )
    log.info("sim_profile", points=len(points), model=model)
    return table


def _point(
    runner: ModelRunner, kv: KVManager, kind: str, n: int, context: int, grid: ProfileGrid
) -> float:
    """One step's median seconds: one chunk of `n` tokens after `context` positions, `n`
    decodes after `context` positions each, or (batch) `context` chunks of `n` tokens each."""
    if kind == "batch":
        counts = [(0, n)] * context
    else:
        counts = [(context, n)] if kind == "prefill" else [(context, 1)] * n
    reqs, seqs = [], []
    try:
        for i, (start, tokens) in enumerate(counts):
            req = Request(PROFILE_ID.format(i), [], SamplingParams(max_tokens=1 << 20))
            req.prompt_ids = [(31 * p + i) % runner.vocab_size for p in range(start + tokens)]
            req.slot = i
            reqs.append(req)
            if not kv.grow(req.request_id, start + tokens):
                raise ProfileError(
                    f"the KV pool holds no {kind} step of {n} at context {context}; raise "
                    "--kv-cache-memory-gb"
                )
            seqs.append(ScheduledSeq(req, start, tokens, True, 0))
        return _time(runner, kv, SchedulerStep(seqs), grid.repeats, grid.point_seconds)
    finally:
        for req in reqs:
            kv.free(req.request_id)


def _grid(
    measured: dict[tuple[str, int, int], float],
    kind: str,
    rows: tuple[int, ...],
    columns: tuple[int, ...],
) -> Grid:
    """The measured points, each row then each column made non-decreasing (against noise)."""
    seconds = [_non_decreasing([measured[kind, r, c] for c in columns]) for r in rows]
    by_column = [
        _non_decreasing([seconds[i][j] for i in range(len(rows))]) for j in range(len(columns))
    ]
    seconds = [[by_column[j][i] for j in range(len(columns))] for i in range(len(rows))]
    return Grid(list(rows), list(columns), seconds)


def _host_copies(runner: ModelRunner, kv: KVManager, n: int) -> tuple[Bandwidth, Bandwidth]:
    """The copier's gather (device -> host) and scatter (host -> device) of `n` blocks."""
    copier = runner.copier
    assert copier is not None
    req = PROFILE_ID.format("copy")
    if not kv.grow(req, n * kv.prefix_block):
        raise ProfileError(f"the KV pool holds no {n} blocks to copy")
    try:
        blocks = [[t[i] for t in kv.block_tables(req)] for i in range(n)]
        sync = runner.device_module.synchronize if runner.device_module else lambda: None
        saves, loads = [], []
        with torch.inference_mode():
            for _ in range(6):
                sync()
                t0 = time.perf_counter()
                payloads = copier.gather(blocks)
                sync()
                t1 = time.perf_counter()
                copier.scatter(blocks, payloads)
                sync()
                saves.append(t1 - t0)
                loads.append(time.perf_counter() - t1)
    finally:
        kv.free(req)
    nbytes = n * copier.block_bytes
    return (  # the first of each is a warm-up
        Bandwidth(nbytes / statistics.median(saves[1:])),
        Bandwidth(nbytes / statistics.median(loads[1:])),
    )


def _store(block_bytes: int, n: int, repeats: int) -> tuple[Bandwidth, Bandwidth]:
    """A BlockStore in a temporary directory (beside the system's temp files; the page cache
    warm, as a just-written block is): chain reads' latency (one block) and bandwidth (`n`),
    writes' bandwidth."""
    payload = torch.randint(0, 256, (block_bytes,), dtype=torch.uint8)
    with tempfile.TemporaryDirectory(prefix="deepinfer-profile-store-") as root:
        store = BlockStore(root, b"deepinfer-profil", block_bytes)  # 16 bytes, as a salt
        try:
            keys = [i.to_bytes(16, "big") for i in range(n)]
            t0 = time.perf_counter()
            for key in keys:
                store.write(key, payload, "chat")
            write_s = time.perf_counter() - t0
            one, chain = [], []
            for _ in range(max(repeats, 3)):
                t0 = time.perf_counter()
                asyncio.run(store.load_chain(keys[:1]))
                one.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                found = asyncio.run(store.load_chain(keys))
                chain.append(time.perf_counter() - t0)
            if len(found) != n:
                raise ProfileError(f"the block store read back {len(found)} of {n} blocks")
        finally:
            store.close()
    latency = statistics.median(one)
    rest = max(statistics.median(chain) - latency, 1e-9)
    return (
        Bandwidth((n - 1) * block_bytes / rest if n > 1 else block_bytes / latency, latency),
        Bandwidth(n * block_bytes / write_s),
    )


def _provenance(runner: ModelRunner, model: str, dtype: str, load: float) -> Provenance:
    device = runner.device.type
    if runner.device_module is not None:
        chip = runner.device_module.get_device_name(runner.device)
    else:
        chip = _cpu_name()
    return Provenance(
        where=f"{socket.gethostname()}: {chip}, {len(os.sched_getaffinity(0))} cores",
        when=datetime.now(UTC).isoformat(timespec="seconds"),
        device=device,
        model=model,
        dtype=dtype,
        threads=runner.cpu_threads,
        torch=torch.__version__,
        command="deepinfer " + " ".join(sys.argv[1:]) if sys.argv else "",
        note=f"measured by deepinfer profile on {platform.platform()}; load average "
        f"{load:.2f} at the start (other processes' share of the cores)",
    )


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"

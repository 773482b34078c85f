"""One batched DeepSeek-V4 decode step at long contexts, run on the cache directly (it holds
random entries: no prefill needed): the metadata the host builds for it, the time to build it
and to run the step, and the step's peak memory above the process's resident set before it.

    python -m bench.v4_long_decode [--batch 8 --contexts 4096 16384 65536 --flash-indexer]

--flash-indexer gives the bench model V4-Flash's indexer (64 heads of 128, top-512), whose
per-head scores are what grows with the context. Each context runs in a process of its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench.common import machine, quiet_logs
from bench.v4_throughput import V4_BENCH, describe, make_bench_checkpoint

FLASH_INDEXER = dict(index_n_heads=64, index_head_dim=128, index_topk=512)


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor reachable through dataclass fields, dicts and lists."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(tensor_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def _status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field_name} in /proc/self/status")


def _reset_peak() -> None:
    """The peak resident set (VmHWM) back to the current one (Linux ≥ 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def one_context(path: Path, batch: int, context: int, steps: int) -> dict[str, float]:
    """The measurements at one context, in this process."""
    from daemon.models.base import SeqSlice
    from daemon.models.deepseek_v4.cache import V4Cache
    from daemon.models.deepseek_v4.config import CSA, HCA
    from daemon.models.deepseek_v4.kv import STATE, SWA
    from daemon.models.loader import load_model

    torch.manual_seed(0)
    model = load_model(path, torch.device("cpu"), torch.float32).model
    cfg = model.cfg
    groups = model.kv_groups(torch.float32, 0)
    per_request = -(-context // cfg.block_tokens)
    blocks = {SWA: batch, STATE: batch, CSA: batch * per_request, HCA: batch * per_request}
    names = [g.spec.name for g in groups]
    cache = V4Cache(cfg, groups, [blocks[n] for n in names], torch.device("cpu"))
    for ring in cache.swa:
        ring.normal_(0, 0.5)
    for st in list(cache.layers.values()) + list(cache.indexers.values()):
        st.entries.normal_(0, 0.5)
    tables = {
        SWA: lambda i: [i],
        STATE: lambda i: [i],
        CSA: lambda i: list(range(i * per_request, (i + 1) * per_request)),
        HCA: lambda i: list(range(i * per_request, (i + 1) * per_request)),
    }
    seqs = [SeqSlice(i, context - 1, 1, [tables[n](i) for n in names], True) for i in range(batch)]
    ids = torch.randint(2, cfg.vocab_size, (batch,))
    positions = torch.full((batch,), context - 1, dtype=torch.long)
    build, run, peak = [], [], 0
    with torch.inference_mode():
        for step in range(steps + 1):
            t0 = time.perf_counter()
            meta = cache.build_attention(seqs)
            t1 = time.perf_counter()
            rss = _status_kib("VmRSS")
            _reset_peak()
            model.compute_logits(model(ids, positions, meta, cache)).argmax(-1)
            t2 = time.perf_counter()
            if step == 0:  # the first step's peak, before any allocator reuse
                peak = _status_kib("VmHWM") - rss
                metadata = tensor_bytes(meta.decodes)
            else:
                build.append(t1 - t0)
                run.append(t2 - t1)
    return dict(
        metadata_kib=metadata / 1024,
        build_ms=1e3 * statistics.median(build),
        step_ms=1e3 * statistics.median(run),
        peak_mib=peak / 1024,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--steps", type=int, default=5, help="timed steps per context (median)")
    p.add_argument("--flash-indexer", action="store_true")
    p.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)  # a child's
    p.add_argument("--context", type=int, help=argparse.SUPPRESS)  # a child's
    args = p.parse_args()
    quiet_logs()
    if args.context:
        out = one_context(args.checkpoint, args.batch, args.context, args.steps)
        print(json.dumps(out))
        return
    overrides: dict[str, Any] = dict(max_position_embeddings=max(args.contexts) + 128)
    if args.flash_indexer:
        overrides |= FLASH_INDEXER
    print("model:", describe(V4_BENCH | overrides), "|", machine())
    path = make_bench_checkpoint(Path(tempfile.mkdtemp(prefix="deepinfer-v4-long-")), **overrides)
    print(
        f"{args.batch} decodes at each context; median of {args.steps} steps; peak = the first "
        "step's resident-set high-water mark above the set before it"
    )
    print(f"{'context':>8} {'metadata':>11} {'build':>9} {'step':>10} {'peak':>10}")
    for context in tqdm(args.contexts, desc="contexts", leave=False):
        child = [sys.executable, "-m", "bench.v4_long_decode", "--checkpoint", str(path)]
        child += ["--context", str(context), "--batch", str(args.batch), "--steps", str(args.steps)]
        done = subprocess.run(child, capture_output=True, text=True, check=True)
        r = json.loads(done.stdout.strip().splitlines()[-1])
        tqdm.write(
            f"{context:>8} {r['metadata_kib']:>7.1f} KiB {r['build_ms']:>6.2f} ms "
            f"{r['step_ms']:>7.1f} ms {r['peak_mib']:>6.1f} MiB"
        )


if __name__ == "__main__":
    main()

"""The seed's per-card figures as a cost table, derived on paper (not measured): prefill ~60K
tok/s on a miss, decode >14K tok/s per card; and a Mooncake-format trace at the seed's 96 %
input hit rate. `python -m daemon.sim.paper --out F [--trace-out T --rate R ...]`."""

from __future__ import annotations

import argparse
import json
import random
from datetime import UTC, datetime
from pathlib import Path

from daemon.sim.table import Bandwidth, CostTable, Grid, KVGeometry, Provenance

PREFILL_TOK_S = 60_000.0  # one card, every token computed (a cache miss)
# a decode step: one pass over the card's weights, a little per sequence, and its KV read
DECODE_BASE_S = 5e-3
DECODE_PER_SEQ_S = 1e-5
HBM_BYTES_S = 4e12  # the KV read's bandwidth (an H200's HBM is 4.8 TB/s)
# a stand-in for DeepSeek-V4's compressed KV: 61 layers, 64 bf16 values of K and of V per
# token and layer (~15.6 KB a token), blocks of 128 tokens (not measured)
KV = KVGeometry(block_size=128, num_layers=61, num_kv_heads=1, head_dim=64, dtype="bfloat16")
PREFILL_ROWS = [128, 512, 2048, 8192]
DECODE_ROWS = [1, 16, 64, 128, 256]
CONTEXTS = [0, 8192, 32768, 131072]
DECODE_CONTEXTS = [1024, 8192, 32768, 131072]


def prefill_seconds(tokens: int, context: int) -> float:
    """60K tok/s at no context; attention over what was computed before adds up to 2x."""
    return max(tokens / PREFILL_TOK_S * (1 + context / 131072), 2e-3)


def decode_seconds(seqs: int, context: int) -> float:
    kv_bytes = seqs * max(context, 1) * KV.bytes_per_block / KV.block_size
    return DECODE_BASE_S + seqs * DECODE_PER_SEQ_S + kv_bytes / HBM_BYTES_S


def seed_table() -> CostTable:
    prov = Provenance(
        where="on paper: the seed's per-card figures (docs/structure.md)",
        when=datetime.now(UTC).isoformat(timespec="seconds"),
        device="cuda",
        model="DeepSeek-V4 (per card, as the seed reports it)",
        dtype="bfloat16",
        command="python -m daemon.sim.paper",
        note=(
            "derived, not measured: prefill 60K tok/s per card on a miss (a full hit's ~1.5M "
            "follows from the cached tokens not being computed), decode 5 ms + 10 us per "
            "sequence + the KV read at 4 TB/s (128 sequences at 4K context: ~15K tok/s, the "
            "seed's >14K); KV geometry a stand-in for V4's compressed KV; host copies at "
            "PCIe 5 speed, the store at 3FS-like 20 / 10 GB/s per node"
        ),
    )
    return CostTable(
        prov,
        KV,
        Grid(
            PREFILL_ROWS,
            CONTEXTS,
            [[prefill_seconds(t, c) for c in CONTEXTS] for t in PREFILL_ROWS],
        ),
        Grid(
            DECODE_ROWS,
            DECODE_CONTEXTS,
            [[decode_seconds(s, c) for c in DECODE_CONTEXTS] for s in DECODE_ROWS],
        ),
        host_save=Bandwidth(50e9, 1e-5),
        host_load=Bandwidth(50e9, 1e-5),
        store_read=Bandwidth(20e9, 5e-4),
        store_write=Bandwidth(10e9, 5e-4),
        max_num_batched_tokens=8192,
        max_num_seqs=256,
    )


def hit_trace(
    rate: float,
    seconds: float,
    hit: float = 0.96,
    input_length: int = 12_000,
    output_length: int = 343,
    documents: int = 64,
    seed: int = 0,
) -> list[dict]:
    """Poisson arrivals at `rate` a second for `seconds`: each prompt is one of `documents`
    shared prefixes (the share `hit` of its blocks, a session's history) and new blocks after
    it; lengths and outputs vary +-25 % around the means (the conversation trace's: 12K in,
    343 out). Its hit rate tends to `hit` as each prefix comes back (misses: the first use)."""
    rng = random.Random(seed)
    shared = round(hit * input_length * 1.25 / 512) + 1  # the longest prompt's prefix
    docs = [[d * 10_000 + b for b in range(shared)] for d in range(documents)]
    fresh = 10_000 * documents
    lines, t = [], rng.expovariate(rate)
    while t < seconds:
        n = max(2, round(input_length * rng.uniform(0.75, 1.25)))
        ids = list(rng.choice(docs))[: min(round(hit * n / 512), (n - 1) // 512)]
        while len(ids) * 512 < n:
            ids.append(fresh)
            fresh += 1
        out = max(1, round(output_length * rng.uniform(0.75, 1.25)))
        lines.append(
            {"timestamp": round(t * 1000), "input_length": n, "output_length": out, "hash_ids": ids}
        )
        t += rng.expovariate(rate)
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True, help="the cost table")
    p.add_argument("--trace-out", help="also a trace at the seed's hit rate, here")
    p.add_argument("--rate", type=float, default=100.0, help="requests a second")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--hit", type=float, default=0.96)
    p.add_argument("--documents", type=int, default=64)
    args = p.parse_args()
    seed_table().save(args.out)
    if args.trace_out:
        lines = hit_trace(args.rate, args.seconds, args.hit, documents=args.documents)
        Path(args.trace_out).write_text("".join(json.dumps(x) + "\n" for x in lines))


if __name__ == "__main__":
    main()

"""The seed's per-card figures as a cost table, derived on paper (not measured): prefill ~60K
tok/s on a miss, decode >14K tok/s per card; `python -m daemon.sim.paper --out F` writes it."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    seed_table().save(p.parse_args().out)


if __name__ == "__main__":
    main()

"""KV bytes per token for the real DeepSeek-V4-Flash dimensions, from the engine's own KV specs:
long-term block state (paged, per token) vs short-term state (per running request), and the
raw cache a plain MQA of head_dim 512 would need; then the block store's file bytes per token
and the disk a retention window needs. No weights needed.

    python -m bench.v4_kv_bytes [--dtype bfloat16 --context 1048576]
        [--ingest-tok-s 1e4 1e5 1e6 --days 1 3 7 --replicas 1 --fs-block 4096]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from tqdm import tqdm

from daemon.kv.manager import KVManager
from daemon.kv.store_format import HEADER_BYTES
from daemon.kv.traffic import DAY, DEFAULT_RETENTION_S
from daemon.models.deepseek_v4.config import CSA, HCA, SLIDING, V4Config
from daemon.models.deepseek_v4.kv import STATE, SWA, kv_groups, ring_size

# DeepSeek-V4-Flash (the fields that shape the KV state; layer_types left to the defaults:
# 2 HCA, then CSA/HCA interleaved, as transformers' DeepseekV4Config gives them)
FLASH: dict[str, Any] = dict(
    vocab_size=129280,
    hidden_size=4096,
    num_hidden_layers=43,
    num_attention_heads=64,
    head_dim=512,
    q_lora_rank=1024,
    o_groups=8,
    o_lora_rank=1024,
    n_routed_experts=256,
    num_experts_per_tok=6,
    moe_intermediate_size=2048,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=512,
    sliding_window=128,
    compress_rates={CSA: 4, HCA: 128},
    hc_mult=4,
    max_position_embeddings=1048576,
    torch_dtype="bfloat16",
)

MiB = 2**20
SHORT = {CSA: "csa", HCA: "hca"}


def default_layer_types(n: int) -> list[str]:
    """What transformers' DeepseekV4Config gives when layer_types is not set."""
    try:
        from transformers import DeepseekV4Config

        kwargs = {k: v for k, v in FLASH.items() if k != "torch_dtype"}
        return list(DeepseekV4Config(**kwargs).layer_types)
    except ImportError:  # the same rule, written out
        return [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]


def human(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", MiB), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def group_detail(cfg: V4Config, name: str) -> str:
    hd, ihd, B, m, mh = (
        cfg.head_dim,
        cfg.index_head_dim,
        cfg.block_tokens,
        cfg.csa_rate,
        cfg.hca_rate,
    )
    return {
        SWA: f"ring of {ring_size(cfg)} raw KV x {hd} per layer "
        f"(W-1={cfg.sliding_window - 1} + one block of {B})",
        STATE: f"fp32 open-window kv+gate (CSA {m} x 2x({hd}+{ihd}), HCA {mh} x {hd}) "
        f"+ CSA overlap kv+gate {m} x ({hd}+{ihd})",
        CSA: f"{B // m} entries x ({hd}+{ihd}) + fp32 overlap {m} x ({hd}+{ihd}) kv+gate "
        "at the block end",
        HCA: f"{B // mh} entry x {hd}",
    }[name]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--context", type=int, default=1 << 20, help="context for amortised figures")
    p.add_argument(
        "--ingest-tok-s",
        type=float,
        nargs="+",
        default=[1e4, 1e5, 1e6],
        help="new (uncached) tokens per second written to the block store",
    )
    days = sorted({1.0, *(s / DAY for s in DEFAULT_RETENTION_S.values())})
    p.add_argument("--days", type=float, nargs="+", default=days, help="retention windows")
    p.add_argument("--replicas", type=int, default=1, help="copies the file system keeps")
    p.add_argument("--fs-block", type=int, default=4096, help="file allocation unit, bytes")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    item = torch.empty((), dtype=dtype).element_size()

    hf = dict(FLASH)
    hf["layer_types"] = default_layer_types(hf["num_hidden_layers"])
    cfg = V4Config.from_hf(hf)
    groups = kv_groups(cfg, dtype)
    kv = KVManager(groups, 1 << 40, max_num_seqs=1)
    n_csa, n_hca = len(cfg.layers_of(CSA)), len(cfg.layers_of(HCA))
    n_swa_only = len(cfg.layers_of(SLIDING))

    print(
        f"DeepSeek-V4-Flash KV state, {args.dtype}: {cfg.num_layers} layers "
        f"({n_hca} HCA, {n_csa} CSA, {n_swa_only} sliding-only), head_dim {cfg.head_dim}, "
        f"window {cfg.sliding_window}, rates {cfg.csa_rate}/{cfg.hca_rate}, "
        f"indexer {cfg.index_n_heads}x{cfg.index_head_dim}, block {cfg.block_tokens} tokens\n"
    )
    header = f"{'group':<6} {'kind':<12} {'layers':>6} {'bytes/block':>12} {'per token':>11}  holds"
    print(header)
    print("-" * len(header))
    long_term = short_term = 0.0
    for g in tqdm(groups, desc="groups", leave=False):
        s = g.spec
        if s.per_request:
            short_term += s.bytes_per_block
            per_token = "-"
            kind = "per request"
        else:
            long_term += s.bytes_per_block / s.block_size
            per_token = f"{s.bytes_per_block / s.block_size:,.1f} B"
            kind = f"paged/{s.block_size}"
        print(
            f"{SHORT.get(s.name, s.name):<6} {kind:<12} {len(g.layer_ids):>6} {s.bytes_per_block:>12,} "
            f"{per_token:>11}  {group_detail(cfg, s.name)}"
        )
    assert abs(long_term - kv.bytes_per_token()) < 1e-6
    assert short_term == kv.bytes_per_request()

    # what one snapshot in the host SWA cache holds (W-1 raw KV per layer, no extra block)
    snapshot = cfg.num_layers * (cfg.sliding_window - 1) * cfg.head_dim * item
    # a plain MQA cache: one KV head of head_dim 512 at every position of every layer
    mqa_kv = 2 * cfg.num_layers * cfg.head_dim * item  # separate K and V
    mqa_shared = mqa_kv // 2  # K = V, as V4's shared-KV MQA would store it uncompressed
    ctx = args.context
    entries_only = (
        n_csa * (cfg.index_head_dim + cfg.head_dim) * item / cfg.csa_rate
        + n_hca * cfg.head_dim * item / cfg.hca_rate
    )

    print()
    rows = [
        ("long-term block state (paged groups) per token", f"{long_term:,.1f} B"),
        ("  of which compressed entries + indexer keys", f"{entries_only:,.1f} B"),
        (
            "  of which CSA overlap state stored per block (fp32)",
            f"{long_term - entries_only:,.1f} B",
        ),
        ("short-term state per running request (SWA ring + compressors)", human(short_term)),
        (f"  amortised over a {ctx:,}-token context", f"{short_term / ctx:,.1f} B/token"),
        ("  host SWA-cache snapshot per stored boundary (W-1 per layer)", human(snapshot)),
        ("plain MQA, head_dim 512, K and V, per token", f"{mqa_kv:,} B"),
        ("plain MQA, head_dim 512, shared K=V, per token", f"{mqa_shared:,} B"),
        ("ratio MQA (K+V) / V4 long-term", f"{mqa_kv / long_term:.1f}x"),
        ("ratio MQA (shared K=V) / V4 long-term", f"{mqa_shared / long_term:.1f}x"),
        (
            f"ratio MQA (K+V) / V4 long-term + amortised short-term at {ctx:,}",
            f"{mqa_kv / (long_term + short_term / ctx):.1f}x",
        ),
        (
            f"V4 KV of one {ctx:,}-token context (long-term + one request)",
            human(long_term * ctx + short_term),
        ),
        (f"plain MQA (K+V) KV of one {ctx:,}-token context", human(mqa_kv * ctx)),
    ]
    width = max(len(r[0]) for r in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value:>14}")
    print()
    store_view(cfg, groups, mqa_kv, mqa_shared, args)


def store_view(cfg: V4Config, groups: list, mqa_kv: int, mqa_shared: int, args) -> None:
    """Block store: one file per prefix block = header + every paged group's block."""
    paged = [g.spec for g in groups if not g.spec.per_request]
    (block,) = {s.block_size for s in paged}
    payload = sum(s.bytes_per_block for s in paged)
    file_bytes = payload + HEADER_BYTES
    unit = args.fs_block
    allocated = -(-file_bytes // unit) * unit
    per_token = file_bytes / block
    on_disk = allocated * args.replicas / block
    rows = [
        (f"block store file per {block}-token block: payload (paged groups)", f"{payload:,} B"),
        ("  + header", f"{HEADER_BYTES} B"),
        ("  = file", f"{file_bytes:,} B"),
        (f"  allocated in {unit:,} B units", f"{allocated:,} B"),
        ("store bytes per token (file / block)", f"{per_token:,.1f} B"),
        (f"  on disk ({unit:,} B units, {args.replicas} replica(s))", f"{on_disk:,.1f} B"),
        ("raw KV per token, every layer full attention, K=V (MQA 512)", f"{mqa_shared:,} B"),
        ("raw KV per token, every layer full attention, K and V", f"{mqa_kv:,} B"),
        ("ratio raw (K=V) / store", f"{mqa_shared / per_token:.2f}x"),
        ("ratio raw (K+V) / store", f"{mqa_kv / per_token:.2f}x"),
    ]
    width = max(len(r[0]) for r in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value:>14}")

    def tb(bytes_per_token: float, rate: float, days: float) -> float:
        return bytes_per_token * rate * days * DAY / 1e12

    print(
        "\nstore size to keep N days of new tokens, TB (1e12 B): on disk as above, "
        "(raw K=V in brackets)"
    )
    head = f"{'new tokens/s':>14}" + "".join(f"{f'{d:g} d':>20}" for d in args.days)
    print(head)
    for rate in args.ingest_tok_s:
        cells = "".join(
            f"{f'{tb(on_disk, rate, d):,.1f} ({tb(mqa_shared, rate, d):,.0f})':>20}"
            for d in args.days
        )
        print(f"{rate:>14,.0f}{cells}")
    print(
        "assumes: every new token is stored once, in full blocks (a prompt's last partial block "
        "is not stored); nothing is re-read in the window (a hit refreshes a block's retention "
        "without adding bytes); the SWA snapshots stay in host memory (not in the store)"
    )


if __name__ == "__main__":
    main()

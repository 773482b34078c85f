"""What an engine is built from: model, device, KV memory and tiers, MoE."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from daemon.loop.spec.policy import MIN_GAIN

DEVICES = ("auto", "cpu", "cuda", "npu")  # auto: cuda when torch sees one, else cpu
DTYPES = ("auto", "float32", "float16", "bfloat16")  # auto: the checkpoint's (fp32 on a CPU)
# built-in models (build.demo) served without a model: real SmolLM2 (the default), random V4
SMOLLM2, DEEPSEEK_V4 = "smollm2", "deepseek-v4"
DEMOS = (SMOLLM2, DEEPSEEK_V4)


@dataclass
class EngineConfig:
    model: str | None = None  # checkpoint directory or GGUF file; None = a built-in demo model
    demo: str | None = None  # one of DEMOS, only without a model; None = the first
    served_model_name: str | None = None
    device: str = "auto"  # one of DEVICES
    dtype: str = "auto"  # one of DTYPES
    kv_cache_memory_gb: float = 1.0
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None = the checkpoint's max_position_embeddings
    # None: on with an accelerator; on a CPU only where the forward leaves a core to the loop
    overlap: bool | None = None
    # every step eager: no CUDA graphs (cuda), no compiled decode forward (cpu); by default
    # as DEEPINFER_ENGINE_ENFORCE_EAGER says (the test suite sets it)
    enforce_eager: bool = field(default_factory=lambda: _env_flag("DEEPINFER_ENGINE_ENFORCE_EAGER"))
    # a GGUF checkpoint's dequantized weights kept under DEEPINFER_CACHE/weights: a restart
    # reads them instead of dequantizing again (a file as large as the weights in `dtype`)
    gguf_weight_cache: bool = True
    cpu_threads: int = 0  # torch threads for a CPU device; 0 = all (one left free if > 4)
    seed: int = 0
    prefix_caching: bool = True
    swa_miss_policy: str = "replay"  # one of kv.swa_policy.POLICIES
    swa_cache_memory_gb: float = 1.0
    swa_cache_ttl_s: float = 180.0
    host_cache_memory_gb: float = 4.0  # host-memory tier of the prefix cache (0 = off)
    image_cache_memory_gb: float = 0.5  # a vision model's image embeddings by content hash
    kv_store_dir: str | None = None  # block store directory (a 3FS mount, or local); None = off
    kv_store_fsync: bool = False  # fsync each block before publishing it
    kv_store_io_threads: int = 8
    kv_store_capacity_gb: float = 0.0  # 0 = the size of the store's file system
    kv_store_high_watermark: float = 0.9  # above this fraction of capacity, evict ...
    kv_store_low_watermark: float = 0.8  # ... down to this one
    kv_store_gc_interval_s: float = 300.0
    kv_store_read_timeout_s: float = 10.0  # a block read not back by then is a miss
    traffic_classes: list[str] = field(default_factory=list)  # NAME=DURATION retention overrides
    # expert parallelism (MoE models): one daemon process per rank, ranks step together
    ep_size: int = 1
    ep_rank: int = 0
    ep_master: str = "127.0.0.1:29500"  # host:port where rank 0 listens for the group
    ep_slots_per_rank: int = 0  # expert slots per rank; 0 = ceil(experts / ranks) + 1
    moe_stats_interval: int = 1000  # steps between expert-load samples
    moe_rebalance_interval: int = 10000  # steps between placements (0 = only on command)
    moe_stats_window: int = 10  # samples the placement looks at
    # speculative decoding: the drafter (loop.spec.drafters.DRAFTERS; None: off), the most
    # drafts a request verifies in a step, and how many it does (loop.spec.policy.POLICIES:
    # adaptive by expected tokens per second against a step-cost table profiled at start,
    # fixed: all of them)
    speculative: str | None = None
    num_speculative_tokens: int = 5
    spec_policy: str = "adaptive"
    # adaptive: verify drafts only where their expected tokens per second beat none's by this
    # share (the error of the policy's model: AdaptivePolicy)
    spec_min_gain: float = MIN_GAIN
    # layer-skip drafting: the target's first layers that draft (0: half of them)
    draft_layers: int = 0
    # draft-model drafting: a small model with the target's tokenizer (checkpoint directory or
    # GGUF file); given alone, it turns speculative decoding on with it
    draft_model: str | None = None


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes", "on")

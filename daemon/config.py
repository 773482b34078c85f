"""Engine and server settings, shared by the CLI, the engine and the tests."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineConfig:
    model: str | None = None  # checkpoint directory; None = the built-in demo model
    served_model_name: str | None = None
    device: str = "auto"  # auto | cpu | cuda | npu
    dtype: str = "auto"  # auto (from the config) | float32 | float16 | bfloat16
    kv_cache_memory_gb: float = 1.0
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None = the checkpoint's max_position_embeddings
    # None: on with an accelerator; on a CPU only where the forward leaves a core to the loop
    overlap: bool | None = None
    enforce_eager: bool = False  # no CUDA graphs (they replay decode steps on cuda)
    cpu_threads: int = 0  # torch threads for a CPU device; 0 = all (one left free if > 4)
    seed: int = 0
    prefix_caching: bool = True
    swa_miss_policy: str = "replay"  # replay (layers x (W-1) tokens) | window (W) | exact
    swa_cache_memory_gb: float = 1.0
    swa_cache_ttl_s: float = 180.0
    host_cache_memory_gb: float = 4.0  # host-memory tier of the prefix cache (0 = off)
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


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 8 * 1024 * 1024
    shutdown_timeout: float = 10.0  # seconds in-flight requests get to finish on SIGTERM
    api_key: str | None = None  # when set, requests need `Authorization: Bearer` or `x-api-key`
    admin_socket: str | None = None  # Unix socket for live administration (mode 0600)
    max_waiting: int = 0  # answer 429 once this many requests wait for the engine (0 = off)
    # DeepSeek-V4, a request that does not say whether to think: auto (Messages no, as
    # Anthropic's API; Chat Completions and Responses yes, as DeepSeek's) | on | off
    thinking_default: str = "auto"
    # the format of dense models' tool calls, as vLLM's --tool-call-parser:
    # auto (the one the chat template teaches) | hermes | llama3_json | none (no tools)
    tool_call_parser: str = "auto"
    # Responses kept for retrieval and `previous_response_id` (OpenAI's `store`), in host memory:
    # least recently used out past the count or the memory, dropped ttl seconds after last use
    response_store_max_count: int = 10_000  # 0 = keep none
    response_store_memory_gb: float = 0.5
    response_store_ttl_s: float = 3600.0

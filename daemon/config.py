"""Engine and server settings, shared by the CLI, the engine and the tests."""

from __future__ import annotations

from dataclasses import dataclass


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
    overlap: bool = True
    cpu_threads: int = (
        0  # torch threads for a CPU device; 0 = all cores, one left free with overlap
    )
    seed: int = 0
    prefix_caching: bool = True
    swa_miss_policy: str = "replay"  # replay (bounded, approximate) | exact
    swa_cache_memory_gb: float = 1.0
    swa_cache_ttl_s: float = 180.0


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 8 * 1024 * 1024
    shutdown_timeout: float = 10.0  # seconds in-flight requests get to finish on SIGTERM
    api_key: str | None = None  # when set, requests need `Authorization: Bearer` or `x-api-key`
    max_waiting: int = 0  # answer 429 once this many requests wait for the engine (0 = off)

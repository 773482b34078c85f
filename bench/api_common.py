"""Shared pieces of the API benchmarks: the cheapest DeepSeek-V4 checkpoint that speaks the
real V4 tokenizer, and an in-process server on a free port."""

from __future__ import annotations

import tempfile
from pathlib import Path

from daemon.api.http.config import ServerConfig
from daemon.build.config import EngineConfig
from daemon.models.checkpoints import copy_tokenizer, make_v4_checkpoint
from daemon.service.live_server import LiveServer

NAME = "bench-v4"
CHEAPEST_V4 = dict(
    vocab_size=129280,
    hidden_size=32,
    moe_intermediate_size=16,
    num_hidden_layers=1,
    layer_types=["compressed_sparse_attention"],
    mlp_layer_types=["moe"],
)


def cheapest_v4_checkpoint(root: Path | None = None) -> Path:
    path = Path(root or tempfile.mkdtemp(prefix="bench-v4-"))
    return copy_tokenizer(make_v4_checkpoint(path, **CHEAPEST_V4))


def start_server(model: Path, max_num_seqs: int = 64, overlap: bool = True) -> LiveServer:
    server = LiveServer(
        EngineConfig(
            model=str(model),
            served_model_name=NAME,
            kv_cache_memory_gb=0.5,
            max_num_seqs=max_num_seqs,
            max_model_len=4096,
            overlap=overlap,
        ),
        ServerConfig(host="127.0.0.1", port=0, shutdown_timeout=1),
    )
    server.start()
    return server

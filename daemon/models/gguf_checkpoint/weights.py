"""GGUF tensors as Hugging Face checkpoint tensors: names mapped, quantized blocks dequantized
(gguf's own reference dequantization), llama.cpp's q/k row permutation undone."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from daemon.models.gguf_checkpoint.reader import GGUFError

Q = GGMLQuantizationType
# The types whose dequantization is checked against gguf's (tests/test_gguf_files.py).
SUPPORTED_TYPES = (
    Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
)  # fmt: skip

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(name: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _BLOCK_NAME.fullmatch(name)
    if m is None or m.group(2) not in _BLOCK:
        raise GGUFError(f"GGUF tensor {name!r} has no place in a dense model")
    layer, part, kind = m.groups()
    return f"model.layers.{layer}.{_BLOCK[part]}.{kind}"


def tensor_of(t: ReaderTensor) -> torch.Tensor:
    """The tensor as float32, in torch's (outermost first) dimension order."""
    if t.tensor_type not in SUPPORTED_TYPES:
        names = ", ".join(q.name for q in SUPPORTED_TYPES)
        raise GGUFError(
            f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, which is not supported "
            f"(supported: {names})"
        )
    # a copy: F32 data comes back as a read-only view of the memory-mapped file
    values = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
    shape = [int(d) for d in reversed(t.shape)]
    return torch.from_numpy(values.reshape(shape))


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert_hf_to_gguf permute of q/k rows (HF's rotate-half halves
    interleaved into pairs for its rope), per head."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(reader: GGUFReader, config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for each GGUF tensor, dequantized one at a time."""
    heads = {
        "attn_q": config["num_attention_heads"],
        "attn_k": config["num_key_value_heads"],
    }
    permuted = config["model_type"] == "llama"
    for t in reader.tensors:
        name = hf_name(t.name)
        tensor = tensor_of(t)
        part = t.name.split(".")[2] if t.name.startswith("blk.") else None
        if permuted and part in heads:
            tensor = unpermute(tensor, heads[part])
        yield name, tensor

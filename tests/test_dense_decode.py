"""The fused dense decode op (kernels/dense_decode_cpu.py, csrc/dense_decode.cpp) against the
model's own eager layers on tiny random Llama checkpoints, fp32 and bf16: the hidden states and
the K/V written, batches of 1 to 9 sequences with vector tails in every loop; which models it
serves, and bad operands refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from daemon.models.attention import AttentionBatch, build_attention_batch
from daemon.models.fused_decode import FusedDecode
from daemon.models.loader import load_model
from kernels import cpu_build
from tests.checkpoints import make_dense_checkpoint

pytestmark = pytest.mark.skipif(not cpu_build.available(), reason="no C++ toolchain")

BLOCK = 16
NUM_BLOCKS = 64
# hidden 72 and ffn 144: 16-lane loops with tails; head_dim 18: RoPE halves of 9
SHAPES = dict(hidden_size=72, heads=4, kv_heads=2, layers=3, intermediate_size=144)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dense_checkpoint(tmp_path_factory.mktemp("llama"), "llama", **SHAPES)


def _model(path: Path, dtype: torch.dtype):
    model = load_model(path, torch.device("cpu"), dtype).model
    groups = model.kv_groups(dtype, BLOCK)
    cache = model.allocate_cache(groups, [NUM_BLOCKS], torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    for kv in cache.layers:  # earlier tokens' K and V
        for t in kv:
            t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    return model, cache


def _decode_batch(contexts: list[int]) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
    """One decode a context (its last position the new token's), each in blocks of its own."""
    tables, slots = [], []
    for i, n in enumerate(contexts):
        per = NUM_BLOCKS // len(contexts)
        table = [i * per + j for j in range(-(-n // BLOCK))]
        tables.append(table)
        slots.append(table[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK)
    batch = build_attention_batch([(t, n) for t, n in zip(tables, contexts)], [], slots, BLOCK)
    ids = torch.randint(2, 500, (len(contexts),), generator=torch.Generator().manual_seed(2))
    return ids, torch.tensor([n - 1 for n in contexts]), batch


def _caches(cache) -> list[torch.Tensor]:
    return [t.clone() for kv in cache.layers for t in kv]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("contexts", [[1], [5, 17], [40, 3, 77, 16, 33, 100, 2, 64, 9]])
def test_fused_decode_equals_the_eager_layers(
    checkpoint: Path, dtype: torch.dtype, contexts: list[int]
) -> None:
    model, cache = _model(checkpoint, dtype)
    fused = FusedDecode.of(model, cache)
    assert fused is not None
    ids, positions, batch = _decode_batch(contexts)
    before = _caches(cache)
    with torch.inference_mode():
        eager = model(ids, positions, batch, cache)
        eager_kv = _caches(cache)
        for t, saved in zip((t for kv in cache.layers for t in kv), before):
            t.copy_(saved)
        got = model.norm(fused.run(model.embed_tokens(ids), positions, batch))
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got, eager, **tol)
    for t, want in zip((t for kv in cache.layers for t in kv), eager_kv):
        torch.testing.assert_close(t, want, **tol)  # the new K / V where eager put them
    slots = batch.slot_mapping
    assert not torch.equal(eager_kv[0][slots], before[0][slots])  # and they were written


def test_models_it_does_not_serve_keep_the_compiled_layer(tmp_path: Path) -> None:
    """Qwen3's q/k norms and Qwen2's qkv bias are not in the op."""
    for arch in ("qwen3", "qwen2"):
        path = make_dense_checkpoint(tmp_path / arch, arch, **SHAPES)
        assert FusedDecode.of(*_model(path, torch.float32)) is None


def test_bad_operands_are_refused(checkpoint: Path) -> None:
    model, cache = _model(checkpoint, torch.float32)
    fused = FusedDecode.of(model, cache)
    assert fused is not None
    ids, positions, batch = _decode_batch([5, 17])
    x = model.embed_tokens(ids)
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="six weights a layer"):
            FusedDecode(**{**vars(fused), "weights": fused.weights[:-1]}).run(x, positions, batch)
        with pytest.raises(RuntimeError, match="position out of range"):
            fused.run(x, positions + 5000, batch)
        far = AttentionBatch(
            batch.slot_mapping + 10**6, 2, batch.decode_tables, batch.decode_mask, [], BLOCK
        )
        with pytest.raises(RuntimeError, match="slot out of range"):
            fused.run(x, positions, far)
        with pytest.raises(RuntimeError, match="in x's dtype"):
            fused.run(x.to(torch.bfloat16), positions, batch)

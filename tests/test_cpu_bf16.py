"""bf16 on a CPU: what `--dtype auto` picks (given the CPU's native-bf16 flags), and how far a
bf16 forward strays from the fp32 one (no further than transformers' own bf16 forward)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from daemon.build.device import cpu_bf16_flags, kernels_widen_bf16, resolve_dtype
from daemon.models.base import SeqSlice
from daemon.models.layers import RMSNorm
from daemon.models.loader import load_model
from daemon.models.rope import RotaryEmbedding
from kernels import cpu_build
from tests.checkpoints import load_reference, make_dense_checkpoint

CPU = torch.device("cpu")
NATIVE = ("avx512_bf16", "amx_bf16")
BF16_ERROR_RATIO = 1.5  # as test_models_v4's: ours within 1.5x of transformers' bf16 error


@pytest.mark.parametrize(
    ("checkpoint", "flags", "expected"),
    [
        ("bfloat16", NATIVE, torch.bfloat16),
        ("bfloat16", ("bf16",), torch.bfloat16),  # aarch64's FEAT_BF16
        ("bfloat16", (), torch.float32),  # torch would emulate bf16: slower than fp32
        ("float16", NATIVE, torch.float32),
        ("float32", NATIVE, torch.float32),  # stored in fp32 (the tests' checkpoints): as stored
        (None, NATIVE, torch.float32),
    ],
)
def test_auto_on_a_cpu(checkpoint: str | None, flags: tuple[str, ...], expected) -> None:
    assert resolve_dtype("auto", checkpoint, CPU, cpu_bf16=flags) == expected


def test_auto_takes_bf16_where_the_kernels_widen_it() -> None:
    """Without native bf16, a bf16 checkpoint is served in bf16 where the model's kernels
    widen it to fp32; they are asked only where that decides."""
    asked = []

    def widened(answer: bool):
        return lambda: asked.append(answer) or answer

    assert resolve_dtype("auto", "bfloat16", CPU, (), widened(True)) == torch.bfloat16
    assert resolve_dtype("auto", "bfloat16", CPU, (), widened(False)) == torch.float32
    assert len(asked) == 2
    assert resolve_dtype("auto", "bfloat16", CPU, NATIVE, widened(False)) == torch.bfloat16
    assert resolve_dtype("auto", "float32", CPU, (), widened(True)) == torch.float32
    assert resolve_dtype("auto", "float16", CPU, (), widened(True)) == torch.float32
    assert resolve_dtype("float32", "bfloat16", CPU, (), widened(True)) == torch.float32
    assert len(asked) == 2


def test_only_dense_models_widen_bf16() -> None:
    """DeepSeek-V4 (its expert GEMMs) and vision models keep fp32 on a CPU without bf16; a
    dense model widens on an AVX-512 CPU without bf16 arithmetic, the C++ kernels built."""
    for model_type in ("deepseek_v4", "llava", None, "gpt2"):
        assert not kernels_widen_bf16(model_type)
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    here = cpu_build.has_avx512() and not native and cpu_build.available()
    assert kernels_widen_bf16("llama") == kernels_widen_bf16("qwen2") == here


def test_auto_off_a_cpu_and_explicit_dtypes() -> None:
    cuda = torch.device("cuda")
    assert resolve_dtype("auto", "bfloat16", cuda, cpu_bf16=()) == torch.bfloat16
    assert resolve_dtype("auto", "float32", cuda, cpu_bf16=NATIVE) == torch.float32
    assert resolve_dtype("bfloat16", "float32", CPU, cpu_bf16=()) == torch.bfloat16
    assert resolve_dtype("float32", "bfloat16", CPU, cpu_bf16=NATIVE) == torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int8", None, CPU, cpu_bf16=NATIVE)


def test_flags_read_from_cpuinfo(tmp_path: Path) -> None:
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f amx_bf16 avx512_bf16 amx_tile\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")
    old = tmp_path / "old"
    old.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_vnni\n")
    assert cpu_bf16_flags(x86) == ("avx512_bf16", "amx_bf16")
    assert cpu_bf16_flags(arm) == ("bf16",)
    assert cpu_bf16_flags(old) == ()


def test_this_cpu_gets_what_its_flags_say() -> None:
    flags = cpu_bf16_flags()
    assert resolve_dtype("auto", "bfloat16", CPU) == (torch.bfloat16 if flags else torch.float32)


# ---- accuracy ----------------------------------------------------------------------------------


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref).norm() / ref.norm()).item()


def test_rms_norm_in_bf16_within_bf16_rounding() -> None:
    """Statistics in fp32 over bf16 activations of large magnitude: the norm of the same bf16
    inputs and weight differs from the fp32 one by one bf16 rounding (2^-8 relative) per
    element; transformers' (cast to bf16, then times the weight) rounds twice, up to 2^-7."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 576, generator=g) * 40).bfloat16()
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576, generator=g) * 4)
    norm = norm.to(torch.bfloat16)
    with torch.no_grad():
        xf = x.float()
        ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.float()
        ours = norm(x)
    assert ours.dtype == torch.bfloat16
    assert ((ours.float() - ref).abs() <= 2**-8 * ref.abs()).all()
    assert relative_error(ours, ref) <= 2**-8


def test_rope_in_bf16_rotates_in_fp32() -> None:
    """Positions past 2^8 (where a bf16 position or angle would be off by whole radians)
    rotate as in fp32, to bf16's rounding."""
    rope = RotaryEmbedding(64, 4096, {"rope_theta": 10000.0, "rope_type": "default"}, CPU)
    x = torch.randn(16, 3, 64, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(4000, 4016)
    ref = rope.apply(x, positions)
    ours = rope.apply(x.bfloat16(), positions)
    assert ours.dtype == torch.bfloat16
    assert relative_error(ours, ref) <= 2**-8


def dense_logits(model, ids: torch.Tensor, dtype: torch.dtype, chunks: list[int]) -> torch.Tensor:
    """Every position's logits (fp32), the prompt in chunks then decodes, over a paged cache
    of `dtype`."""
    block = 16
    (group,) = model.kv_groups(dtype, block)
    num_blocks = -(-len(ids) // block) + 1
    cache = model.allocate_cache([group], [num_blocks], CPU)
    table = list(range(num_blocks))
    out, start = [], 0
    for n in chunks:
        seq = SeqSlice(0, start, n, [table], is_decode=n == 1 and start > 0)
        with torch.inference_mode():
            pos = torch.arange(start, start + n)
            hidden = model(ids[start : start + n], pos, cache.build_attention([seq]), cache)
            out.append(model.compute_logits(hidden))
        start += n
    logits = torch.cat(out)
    assert logits.dtype == torch.float32
    return logits


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_dense_bf16_strays_from_fp32_no_more_than_transformers_bf16(
    model_type: str, tmp_path: Path
) -> None:
    """A dense model served in bf16 (bf16 weights and KV cache; norms, softmax and RoPE
    accumulate in fp32): its logits are as close to the fp32 reference as transformers' bf16
    ones, and greedy tokens mostly agree with fp32's."""
    extra = dict(head_dim=32, tie_word_embeddings=True) if model_type == "qwen3" else {}
    path = make_dense_checkpoint(tmp_path, model_type, layers=3, **extra)
    ids = torch.randint(0, 512, (48,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ref = load_reference(path)(ids[None]).logits[0].float()
        theirs = load_reference(path, torch.bfloat16)(ids[None]).logits[0].float()
    model = load_model(path, CPU, torch.bfloat16).model
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    ours = dense_logits(model, ids, torch.bfloat16, [20, 13, 7] + [1] * 8)
    ours_error, their_error = ((x - ref).abs().mean().item() for x in (ours, theirs))
    print(f"mean |logit - fp32|: ours {ours_error:.3e}, transformers {their_error:.3e}")
    assert ours_error <= BF16_ERROR_RATIO * their_error
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9

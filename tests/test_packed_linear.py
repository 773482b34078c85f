"""`deepinfer::packed_linear` against `F.linear`: eager, compiled, after an in-place write to the
weight, widened, with rows on the plain weight, and the plain fallback; `Linear` and a loaded
dense model packing their weights."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from daemon.models.layers import Linear
from daemon.models.loader import load_model
from kernels import cpu_build, packed_linear
from tests.checkpoints import make_dense_checkpoint
from tests.daemons import in_checkout

BF16 = torch.bfloat16
needs_packing = pytest.mark.skipif(
    not packed_linear.supported(torch.empty(1, 1, dtype=BF16)),
    reason="no plan packs bf16 on this CPU (or DEEPINFER_CPU_KERNELS=0)",
)
needs_kernels = pytest.mark.skipif(
    not (packed_linear.ENABLED and cpu_build.available()), reason="the C++ kernels did not build"
)


def weights(out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_features, in_features, generator=g) * 0.05).to(BF16)
    return w, torch.randn(out_features, generator=g).to(BF16)


def close(ours: torch.Tensor, ref: torch.Tensor) -> bool:
    """Within a bf16 rounding of the output (oneDNN may sum in another order)."""
    return bool(((ours.float() - ref.float()).abs() <= 2**-7 * ref.float().abs() + 1e-2).all())


@needs_packing
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_equals_plain_linear(rows: int) -> None:
    w, b = weights(200, 96, rows)
    assert packed_linear.pack(w)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(9)).to(BF16)
    with torch.inference_mode():
        assert close(packed_linear.linear(x, w, b), F.linear(x, w, b))
        assert close(packed_linear.linear(x, w, None), F.linear(x, w))
        x3 = x.view(1, rows, 96)  # leading dims kept
        assert packed_linear.linear(x3, w, b).shape == (1, rows, 200)


@needs_packing
def test_an_in_place_write_to_the_weight_is_followed() -> None:
    w, _ = weights(64, 32, 1)
    assert packed_linear.pack(w)
    x = torch.randn(4, 32).to(BF16)
    with torch.inference_mode():
        before = packed_linear.linear(x, w, None)
        w.mul_(-2)
        after = packed_linear.linear(x, w, None)
    assert close(after, F.linear(x, w))
    assert not close(after, before)


def test_a_weight_not_packed_runs_plain() -> None:
    for w in (weights(16, 8, 2)[0], torch.randn(16, 8)):  # never packed: bf16, fp32
        x = torch.randn(3, 8, dtype=w.dtype)
        with torch.inference_mode():
            assert torch.equal(packed_linear.linear(x, w, None), F.linear(x, w))
    # fp32 is packed on AMD CPUs and Intel ones without AMX (where MKL's GEMM is slower)
    assert packed_linear.pack(torch.randn(16, 8)) == packed_linear.packs_fp32()
    assert not packed_linear.pack(torch.randn(16, 8).half())


def test_fp32_packing_follows_the_cpu(tmp_path) -> None:
    amd, intel, amx = tmp_path / "amd", tmp_path / "intel", tmp_path / "amx"
    amd.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\n")
    flags = "flags\t\t: fpu avx512f avx512bw"
    intel.write_text(f"processor\t: 0\nvendor_id\t: GenuineIntel\n{flags}\n")
    amx.write_text(f"processor\t: 0\nvendor_id\t: GenuineIntel\n{flags} amx_bf16 amx_tile\n")
    assert packed_linear.packs_fp32(amd) and packed_linear.packs_fp32(intel)
    assert not packed_linear.packs_fp32(amx)
    assert not packed_linear.packs_fp32(tmp_path / "missing")


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 64, 300])
def test_widened_bf16_equals_plain_linear(rows: int) -> None:
    """A bf16 weight packed in fp32 (CPUs without bf16 arithmetic): bf16 in and out, the same
    sums; no rows on the plain weight here, so every count runs widened."""
    w, b = weights(200, 96, rows)
    assert packed_linear.pack(w, packed_linear.Plan(widen=True))
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(9)).to(BF16)
    with torch.inference_mode():
        out = packed_linear.linear(x, w, b)
        assert out.dtype == BF16 and close(out, F.linear(x.float(), w.float(), b.float()))
        assert close(packed_linear.linear(x, w, None), F.linear(x.float(), w.float()))


@pytest.mark.parametrize("rows", [1, 2, 3, 64])
def test_fp32_rows_on_the_plain_weight(rows: int) -> None:
    """Up to the plan's small rows run on the plain fp32 weight (MKL), more on the packed
    copy: a write through `.data` (not counted as a write) shows in the first only."""
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(200, 96, generator=g) * 0.05, torch.randn(200, generator=g)
    assert packed_linear.pack(w, packed_linear.Plan(small_rows=2))
    before = w.clone()
    w.data.mul_(-1)
    x = torch.randn(rows, 96, generator=g)
    with torch.inference_mode():
        read = w if rows <= 2 else before
        torch.testing.assert_close(packed_linear.linear(x, w, b), F.linear(x, read, b))


@pytest.mark.skipif(not packed_linear.packs_fp32(), reason="fp32 is not packed on this CPU")
@pytest.mark.parametrize("rows", [1, 64, 300])
def test_packed_fp32_equals_plain_linear(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(200, 96, generator=g) * 0.05, torch.randn(200, generator=g)
    assert packed_linear.pack(w)
    x = torch.randn(rows, 96, generator=g)
    with torch.inference_mode():
        torch.testing.assert_close(packed_linear.linear(x, w, b), F.linear(x, w, b))


_COMPILED = """
import torch, torch.nn.functional as F
from kernels import packed_linear
g = torch.Generator().manual_seed(3)
w = (torch.randn(128, 64, generator=g) * 0.05).bfloat16()
b = torch.randn(128, generator=g).bfloat16()
assert packed_linear.pack(w)
fn = lambda x, w, b: F.silu(packed_linear.linear(x, w, b))
compiled = torch.compile(fn, fullgraph=True, dynamic=False)
with torch.inference_mode():
    for rows in (5, 33):
        x = torch.randn(rows, 64).bfloat16()
        torch._dynamo.mark_dynamic(x, 0)
        ours, ref = compiled(x, w, b).float(), F.silu(F.linear(x, w, b)).float()
        assert ((ours - ref).abs() <= 2**-7 * ref.abs() + 1e-2).all(), rows
print("COMPILED OK")
"""


@needs_packing
def test_compiled_with_a_dynamic_row_count(tmp_path) -> None:
    """In a process of its own: a compile here would run inductor's ISA probes in the test
    process, which test_compiled_forward's saved graphs record from their own first compile."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    done = in_checkout([sys.executable, "-c", _COMPILED], timeout=300, env=env)
    assert "COMPILED OK" in done.stdout, (done.stdout + done.stderr)[-3000:]


@needs_packing
def test_linear_and_a_loaded_model_pack_their_weights(tmp_path) -> None:
    layer = Linear(32, 48).to(BF16)
    assert not layer.packed
    x = torch.randn(2, 32).to(BF16)
    with torch.inference_mode():
        ref = layer(x)
    layer.pack()
    assert layer.packed
    with torch.inference_mode():
        assert close(layer(x), ref)
    path = make_dense_checkpoint(tmp_path / "ckpt", "llama")
    model = load_model(path, torch.device("cpu"), BF16).model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed for m in linears)
    assert model.head_packed
    fp32 = load_model(path, torch.device("cpu"), torch.float32).model
    fp32_linears = [m.packed for m in fp32.modules() if isinstance(m, Linear)]
    assert fp32_linears == [packed_linear.packs_fp32()] * len(fp32_linears)

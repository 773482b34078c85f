"""The C++ prefill attention (kernels/prefill_attention_cpu.py) in bf16 and fp32 against the
fp32 torch reference: fresh prompts and chunks after cached context, GQA / MHA / MQA, contexts off the
key-block size, token-strided views; and `paged_attention` running it for prefill chunks. bf16 runs
the code this CPU builds: bf16 products with AVX512-BF16, else widened to fp32."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from daemon.models.attention import build_attention_batch, paged_attention
from kernels import cpu_build, paged_attention_cpu, prefill_attention_cpu
from kernels.prefill_attention_cpu import prefill_attention, prefill_reference

BF16 = torch.bfloat16


def usable() -> bool:
    probe = torch.empty(1, 1, 32, dtype=BF16)
    return prefill_attention_cpu.supports(probe, probe, probe, probe)


pytestmark = pytest.mark.skipif(
    not (cpu_build.load() and usable()), reason="needs AVX-512 and the C++ kernels"
)


def case(n: int, ctx: int, hq: int, hkv: int, dim: int, dtype: torch.dtype = BF16):
    g = torch.Generator().manual_seed(n + ctx)
    q = torch.randn(n, hq, dim, generator=g).to(dtype)
    k, v = torch.randn(2, ctx, hkv, dim, generator=g).to(dtype).unbind(0)
    return q, k, v


def error_vs_fp32(got: torch.Tensor, q, k, v, scale: float) -> tuple[float, float]:
    """Our max error against the fp32 reference, and SDPA's own error (in q's dtype) against it."""
    want = prefill_reference(q.float(), k.float(), v.float(), scale)
    sdpa = prefill_reference(q, k, v, scale)
    return (got.float() - want).abs().max().item(), (sdpa.float() - want).abs().max().item()


# bf16: as close as SDPA's own bf16 (its output rounding, 2^-8 relative); fp32: summation order
FLOOR = {BF16: 1e-2, torch.float32: 2e-6}


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize(
    "n,ctx,hq,hkv,dim",
    [
        (256, 256, 9, 3, 64),  # SmolLM2's shape, a fresh prompt
        (300, 300, 9, 3, 64),  # a prompt past two key blocks
        (5, 133, 9, 3, 64),  # a short chunk after cached context off the block size
        (1, 1, 4, 4, 64),  # one token, MHA
        (1, 200, 8, 1, 128),  # MQA, one query after context
        (129, 1000, 16, 2, 32),  # group 8, several query blocks over a long context
    ],
)
def test_op_matches_the_fp32_reference_as_closely_as_sdpa_does(
    n: int, ctx: int, hq: int, hkv: int, dim: int, dtype: torch.dtype
) -> None:
    q, k, v = case(n, ctx, hq, hkv, dim, dtype)
    out = torch.full_like(q, float("nan"))
    scale = dim**-0.5
    prefill_attention(q, k, v, scale, out)
    ours, sdpa = error_vs_fp32(out, q, k, v, scale)
    assert ours <= max(2 * sdpa, FLOOR[dtype]), (ours, sdpa)


def test_token_strided_views_are_read_and_written_in_place() -> None:
    """q, k, v as column slices of one projection (as the model splits qkv), out as rows of a
    bigger buffer: nothing outside `out`'s rows is touched."""
    n, hq, hkv, dim = 40, 6, 2, 64
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(n, hq + 2 * hkv, dim, generator=g).to(BF16)
    q, k, v = qkv.split([hq, hkv, hkv], dim=1)
    buffer = torch.zeros(n + 8, hq, dim, dtype=BF16)
    prefill_attention(q, k, v, 0.125, buffer[4 : 4 + n])
    ours, sdpa = error_vs_fp32(buffer[4 : 4 + n], q, k, v, 0.125)
    assert ours <= max(2 * sdpa, 1e-2)
    assert not buffer[:4].any() and not buffer[4 + n :].any()


def test_bad_inputs_are_refused() -> None:
    q, k, v = case(8, 8, 9, 3, 64)
    with pytest.raises(RuntimeError, match="share a dtype"):
        prefill_attention(q.float(), k, v, 0.125, torch.empty(8, 9, 64))
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        prefill_attention(q.half(), k.half(), v.half(), 0.125, torch.empty_like(q.half()))
    with pytest.raises(RuntimeError, match="n <= ctx"):
        prefill_attention(q, k[:4], v[:4], 0.125, torch.empty_like(q))
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        prefill_attention(q[:, :8], k, v, 0.125, torch.empty_like(q[:, :8]))


def test_paged_attention_runs_it_for_prefill_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode, a fresh prompt and a chunk after 70 cached positions through `paged_attention`
    in bf16 (widened where the CPU has no AVX512-BF16): the prefill rows come from the op and
    agree with the torch path (DEEPINFER_CPU_KERNELS=0) as closely as bf16 allows."""
    hq, hkv, dim, block, blocks = 9, 3, 64, 16, 40
    g = torch.Generator().manual_seed(5)
    tables = [torch.randperm(blocks, generator=g)[:12].tolist() for _ in range(3)]
    decodes = [(tables[0], 30)]
    prefills = [(1, 150, tables[1], 150), (151, 20, tables[2], 90)]
    slots = [tables[0][29 // block] * block + 29 % block]
    for _, q_len, t, ctx in prefills:
        slots += [t[p // block] * block + p % block for p in range(ctx - q_len, ctx)]
    batch = build_attention_batch(decodes, prefills, slots, block)
    q = torch.randn(len(slots), hq, dim, generator=g).to(BF16)
    k, v = torch.randn(2, len(slots), hkv, dim, generator=g).to(BF16).unbind(0)
    caches = torch.randn(2, blocks * block, hkv, dim, generator=g).to(BF16)

    def run() -> torch.Tensor:
        kc, vc = caches[0].clone(), caches[1].clone()
        return paged_attention(q, k, v, kc, vc, batch, dim**-0.5)

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = run()
    calls = [e for e in prof.events() if e.name == "deepinfer::prefill_attention"]
    assert len(calls) == 2
    monkeypatch.setattr(paged_attention_cpu, "ENABLED", False)
    want = run()
    torch.testing.assert_close(got[1:].float(), want[1:].float(), atol=2e-2, rtol=2e-2)

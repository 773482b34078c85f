"""The C++ paged decode attention (kernels/paged_attention_cpu.py) against its torch reference
(gather the blocks, then SDPA): fp32 and bf16, GQA, ragged contexts, padded block tables, the
vector and the scalar kernels, pieces of context merged, a request's verify rows read as one
span, inside torch.compile, and in `paged_attention` beside prefill chunks."""

from __future__ import annotations

import pytest
import torch

from daemon.models.attention import build_attention_batch, paged_attention
from kernels import paged_attention_cpu
from kernels.paged_attention_cpu import (
    context_mask,
    paged_decode_attention,
    paged_decode_reference,
)

BLOCK = 16
NUM_BLOCKS = 96
# 1 position, a block's end and the next one's start, several blocks, an unaligned long one
LENS = [1, 16, 17, 32, 5, 300, 64, 129]


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    paged_attention_cpu.build()


def make_case(
    lens: list[int], hq: int, hkv: int, dim: int, dtype: torch.dtype, pad: int = 2, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """q, caches and block tables (distinct random blocks, each row padded by `pad` more
    blocks past the widest context) for contexts `lens`."""
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(NUM_BLOCKS * BLOCK, hkv, dim, generator=g).to(dtype)
    vc = torch.randn(NUM_BLOCKS * BLOCK, hkv, dim, generator=g).to(dtype)
    q = torch.randn(len(lens), hq, dim, generator=g).to(dtype)
    width = -(-max(lens) // BLOCK) + pad
    tables = torch.stack([torch.randperm(NUM_BLOCKS, generator=g)[:width] for _ in lens])
    return q, kc, vc, tables, torch.tensor(lens)


def reference(q, kc, vc, tables, lens) -> torch.Tensor:
    """The torch path in float32 on the same (possibly bf16-rounded) inputs."""
    mask = context_mask(lens, tables.shape[1] * BLOCK)
    scale = q.shape[-1] ** -0.5
    return paged_decode_reference(q.float(), kc.float(), vc.float(), tables, mask, scale, BLOCK)


TOLERANCE = {torch.float32: dict(atol=2e-6, rtol=2e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("generic", [False, True], ids=["vector", "scalar"])
def test_op_matches_the_torch_reference(
    dtype: torch.dtype, group: int, dim: int, generic: bool
) -> None:
    hkv = 2 if group == 4 else 3
    q, kc, vc, tables, lens = make_case(LENS, group * hkv, hkv, dim, dtype, seed=group * dim)
    got = paged_decode_attention(q, kc, vc, tables, lens, dim**-0.5, BLOCK, generic=generic)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), reference(q, kc, vc, tables, lens), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 2, 3, 7, 40])
def test_context_cut_in_pieces_merges_to_the_same(dtype: torch.dtype, splits: int) -> None:
    # more pieces than a short context has blocks: empty pieces must not count
    q, kc, vc, tables, lens = make_case([300, 1, 40], 9, 3, 64, dtype, seed=splits)
    got = paged_decode_attention(q, kc, vc, tables, lens, 0.125, BLOCK, splits=splits)
    torch.testing.assert_close(got.float(), reference(q, kc, vc, tables, lens), **TOLERANCE[dtype])


def verify_rows(table: list[int], start: int, drafts: int) -> list[tuple[list[int], int]]:
    """A request's rows when it verifies `drafts` tokens after `start` known positions."""
    return [(table, start + j + 1) for j in range(drafts + 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("generic", [False, True], ids=["vector", "scalar"])
def test_verify_rows_of_one_table_give_what_each_row_alone_gives(
    dtype: torch.dtype, generic: bool
) -> None:
    """Rows that share their table (a request's verify rows) are read as one span: the same
    bits as each row on its own, and the reference's values."""
    hq, hkv, dim = 9, 3, 64
    g = torch.Generator().manual_seed(5)
    kc = torch.randn(NUM_BLOCKS * BLOCK, hkv, dim, generator=g).to(dtype)
    vc = torch.randn(NUM_BLOCKS * BLOCK, hkv, dim, generator=g).to(dtype)
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    a, b, c, d = perm[:12], perm[12:24], perm[24:36], perm[36:48]
    ctx = (
        [(a, 40)]
        + verify_rows(b, 14, 8)  # across a block's end
        + [(b[:2] + perm[48:58], 150)]  # shares b's first blocks, then its own
        + verify_rows(c, 100, 19)  # more rows than a span takes
        + [(d, 33), (d, 17), (d, 35), (a, 9)]  # not in order; then back to a
    )
    batch = build_attention_batch(ctx, [], [], BLOCK)
    tables, lens = batch.decode_tables, batch.decode_lens
    q = torch.randn(len(ctx), hq, dim, generator=g).to(dtype)
    for splits in (0, 1, 3):
        got = paged_decode_attention(
            q, kc, vc, tables, lens, dim**-0.5, BLOCK, splits=splits, generic=generic
        )
        want = reference(q, kc, vc, tables, lens)
        torch.testing.assert_close(got.float(), want, **TOLERANCE[dtype])
        if splits == 1:  # (pieces of a span are cut by its longest row: not the same bits)
            alone = [
                paged_decode_attention(
                    q[i : i + 1],
                    kc,
                    vc,
                    tables[i : i + 1],
                    lens[i : i + 1],
                    dim**-0.5,
                    BLOCK,
                    splits=splits,
                    generic=generic,
                )  # fmt: skip
                for i in range(len(ctx))
            ]
            assert torch.equal(got, torch.cat(alone))


def test_single_short_sequence_and_odd_head_dim() -> None:
    # a head_dim with no vector kernel takes the scalar one; group 5 has one of its own
    for lens, hq, hkv, dim in [([1], 9, 3, 64), ([2], 5, 1, 24), ([33], 10, 2, 64)]:
        q, kc, vc, tables, lens_t = make_case(lens, hq, hkv, dim, torch.float32, pad=0)
        got = paged_decode_attention(q, kc, vc, tables, lens_t, dim**-0.5, BLOCK)
        torch.testing.assert_close(got, reference(q, kc, vc, tables, lens_t), atol=2e-6, rtol=2e-5)


def test_strided_query_is_read_as_given() -> None:
    q, kc, vc, tables, lens = make_case([20, 50], 6, 2, 64, torch.float32)
    wide = torch.randn(2, 6, 128)
    wide[..., ::2] = q  # a view with stride 2 on the head dim
    got = paged_decode_attention(wide[..., ::2], kc, vc, tables, lens, 0.125, BLOCK)
    torch.testing.assert_close(got, reference(q, kc, vc, tables, lens), atol=2e-6, rtol=2e-5)


def test_bad_context_lengths_and_blocks_are_refused() -> None:
    q, kc, vc, tables, _ = make_case([20, 50], 6, 2, 64, torch.float32, pad=0)
    for bad in ([0, 50], [20, tables.shape[1] * BLOCK + 1]):
        with pytest.raises(RuntimeError, match="context length"):
            paged_decode_attention(q, kc, vc, tables, torch.tensor(bad), 0.125, BLOCK)
    tables[1, 0] = NUM_BLOCKS  # past the pool
    with pytest.raises(RuntimeError, match="block id"):
        paged_decode_attention(q, kc, vc, tables, torch.tensor([20, 50]), 0.125, BLOCK)


def test_op_inside_torch_compile_fullgraph() -> None:
    q, kc, vc, tables, lens = make_case([7, 200, 33], 9, 3, 64, torch.float32)

    def step(q, kc, vc, tables, lens):
        o = paged_decode_attention(q * 2.0, kc, vc, tables, lens, 0.125, BLOCK)
        return torch.relu(o) + 1.0

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    got = compiled(q, kc, vc, tables, lens)
    torch.testing.assert_close(got, step(q, kc, vc, tables, lens))
    want = torch.relu(reference(q * 2.0, kc, vc, tables, lens)) + 1.0
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_lens", [True, False], ids=["lens", "mask-only"])
def test_paged_attention_uses_the_op_beside_prefill_chunks(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, with_lens: bool
) -> None:
    """One step of 3 decodes, a fresh prompt and a chunk with cached context, through
    `paged_attention` with the kernel and with the torch path (DEEPINFER_CPU_KERNELS=0)."""
    hq, hkv, dim = 9, 3, 64
    g = torch.Generator().manual_seed(1)
    tables = [torch.randperm(NUM_BLOCKS, generator=g)[:24].tolist() for _ in range(5)]
    decodes = [(tables[0], 1), (tables[1], 33), (tables[2], 200)]
    # (q_start, q_len, table, ctx): a 5-token fresh prompt, then 4 tokens after 60 cached
    prefills = [(3, 5, tables[3], 5), (8, 4, tables[4], 64)]
    slots = [t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for t, n in decodes]
    for _, q_len, t, ctx in prefills:
        slots += [t[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx - q_len, ctx)]
    batch = build_attention_batch(decodes, prefills, slots, BLOCK)
    if not with_lens:
        batch.decode_lens = None  # as a captured graph's static batch builds it
    tokens = len(slots)
    q = torch.randn(tokens, hq, dim, generator=g).to(dtype)
    k = torch.randn(tokens, hkv, dim, generator=g).to(dtype)
    v = torch.randn(tokens, hkv, dim, generator=g).to(dtype)
    caches = torch.randn(2, NUM_BLOCKS * BLOCK + BLOCK, hkv, dim, generator=g).to(dtype)

    def run() -> torch.Tensor:
        kc, vc = caches[0].clone(), caches[1].clone()
        return paged_attention(q, k, v, kc, vc, batch, dim**-0.5)

    got = run()
    monkeypatch.setattr(paged_attention_cpu, "ENABLED", False)
    want = run()
    torch.testing.assert_close(got[:3].float(), want[:3].float(), **TOLERANCE[dtype])
    # prefill chunks: where the CPU has AVX512-BF16 the C++ prefill kernel, else the same path
    torch.testing.assert_close(got[3:].float(), want[3:].float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("n,ctx", [(7, 7), (5, 23), (1, 16)])
def test_the_fused_form_of_chunk_attention_equals_the_plain_one(
    heads: tuple[int, int], n: int, ctx: int
) -> None:
    """Repeated KV heads and a lower-right causal bias (what flash kernels take, the default)
    give what the boolean mask and enable_gqa give."""
    from daemon.models.attention import chunk_attention

    hq, hkv = heads
    g = torch.Generator().manual_seed(n * 100 + ctx)
    q = torch.randn(hq, n, 16, generator=g)
    k, v = torch.randn(2, hkv, ctx, 16, generator=g).unbind(0)
    q_pos = torch.arange(ctx - n, ctx)
    mask = None if n == ctx else torch.arange(ctx)[None, :] <= q_pos[:, None]
    plain = chunk_attention(q, k, v, mask, 0.25, fused=False)
    fused = chunk_attention(q, k, v, mask, 0.25, fused=True)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,ctx", [(32, 32), (16, 48)])
def test_cpu_prefill_attention_runs_the_flash_kernel_with_gqa(n: int, ctx: int) -> None:
    """A GQA chunk in bf16 reaches CPU's flash kernel, not the math one, with the KV heads as
    they are (no repeated copy), and gives what the plain call gives."""
    from torch.profiler import ProfilerActivity, profile

    from daemon.models.attention import chunk_attention

    g = torch.Generator().manual_seed(n + ctx)
    q = torch.randn(9, n, 64, generator=g).bfloat16()
    k, v = torch.randn(2, 3, ctx, 64, generator=g).bfloat16().unbind(0)
    q_pos = torch.arange(ctx - n, ctx)
    mask = None if n == ctx else torch.arange(ctx)[None, :] <= q_pos[:, None]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fused = chunk_attention(q, k, v, mask, 0.125)
    names = {e.name for e in prof.events()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names
    assert "aten::repeat_interleave" not in names
    plain = chunk_attention(q, k, v, mask, 0.125, fused=False)
    torch.testing.assert_close(fused.float(), plain.float(), rtol=2e-2, atol=2e-2)

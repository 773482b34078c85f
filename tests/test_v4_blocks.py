"""The DeepSeek-V4 blocks' fast paths (complex RoPE, tokens-last mHC with a bordered Sinkhorn,
grouped MoE with its fallback loop) against the plain formulas of the reference."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from daemon.models.deepseek_v4 import blocks
from daemon.models.deepseek_v4.blocks import HyperConnection, HyperHead, InterleavedRope, MoE

CFG = SimpleNamespace(
    hidden_size=32,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    rms_norm_eps=1e-6,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    swiglu_limit=0.05,  # low enough that the clamps bite
    routed_scaling_factor=1.5,
    vocab_size=64,
)


def randomise(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.3)  # keeps the layout


def rope_reference(x, cos, sin, rope_dim, inverse=False):
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape) * (-1 if inverse else 1)
    rope = x[..., -rope_dim:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rope_dim], rotated.to(x.dtype)), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 3, 24), (7, 24)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_matches_the_pairwise_formula(dtype, shape, inverse) -> None:
    rope = InterleavedRope(8, {"rope_theta": 10000.0}, 4096, torch.device("cpu"))
    x = torch.randn(shape).to(dtype)
    cos, sin = rope.cos_sin(torch.arange(100, 107))
    before = x.clone()
    out = rope.apply(x, cos, sin, inverse)
    assert out.dtype == dtype and torch.equal(x, before)  # a new tensor; x untouched
    expected = rope_reference(x, cos, sin, 8, inverse)
    torch.testing.assert_close(out, expected, atol=1e-6 if dtype == torch.float32 else 1e-2, rtol=0)


def hc_reference(hc: HyperConnection, streams: torch.Tensor, out: torch.Tensor) -> tuple:
    n = hc.hc
    flat = streams.flatten(1)
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + hc.norm_eps)
    pre_w, post_w, comb_w = F.linear(flat, hc.fn).split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = hc.base.split([n, n, n * n])
    pre_s, post_s, comb_s = hc.scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + hc.eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + hc.eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc.eps)
    for _ in range(hc.iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc.eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc.eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1)
    new = post.unsqueeze(-1) * out.unsqueeze(1) + torch.matmul(comb.transpose(-1, -2), streams)
    return collapsed, new


def test_hyper_connection_matches_the_reference() -> None:
    hc, head = HyperConnection(CFG), HyperHead(CFG)
    randomise(hc, 1)
    randomise(head, 2)
    streams, out = torch.randn(9, 4, 32), torch.randn(9, 32)
    with torch.inference_mode():  # as the runner calls the model
        post, comb, collapsed = hc(streams)
        new = HyperConnection.expand(post, comb, out, streams)
        expected_collapsed, expected_new = hc_reference(hc, streams, out)
        torch.testing.assert_close(collapsed, expected_collapsed, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(new, expected_new, atol=1e-5, rtol=1e-5)
        flat = streams.flatten(1)
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + CFG.rms_norm_eps)
        mixed = F.linear(flat, head.hc_fn) * head.hc_scale + head.hc_base
        expected_head = ((torch.sigmoid(mixed) + CFG.hc_eps).unsqueeze(-1) * streams).sum(dim=1)
        torch.testing.assert_close(head(streams), expected_head, atol=1e-5, rtol=1e-5)


def moe_reference(moe: MoE, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    experts, weights = moe.gate(x, ids)
    out = moe.shared_experts(x)
    for t in range(x.shape[0]):
        for e, w in zip(experts[t].tolist(), weights[t]):
            h = F.linear(x[t], moe.gate_up_proj[e])
            gate, up = h.chunk(2)
            h = F.silu(gate.clamp(max=moe.limit)) * up.clamp(-moe.limit, moe.limit)
            out[t] += w * F.linear(h, moe.down_proj[e])
    return out


@pytest.mark.parametrize("hashed", [False, True])
@pytest.mark.parametrize("path", ["grouped_mm", "loop", "padded", "chunked"])
def test_moe_matches_the_per_token_loop(hashed, path, monkeypatch) -> None:
    monkeypatch.setattr(MoE, "_pad_experts", lambda self, x, counts: path == "padded")
    if path == "loop":
        monkeypatch.setattr(blocks, "_grouped_mm_works", lambda device_type: False)
    if path == "chunked":
        monkeypatch.setattr(blocks, "ROUTED_CHUNK", 5)  # 13 tokens: 5 + 5 + 3
    moe = MoE(CFG, hashed)
    randomise(moe, 3)
    if hashed:
        moe.gate.tid2eid = torch.randint(0, CFG.num_experts, (CFG.vocab_size, 2))
    x, ids = torch.randn(13, 32), torch.randint(0, CFG.vocab_size, (13,))
    with torch.inference_mode():
        out = moe(x, ids)
        expected = moe_reference(moe, x, ids)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert moe.take_load().sum().item() == 13 * 2


@pytest.mark.parametrize(
    "b,n,floats,passes", [(2, 300, None, 2), (9, 40, None, 2), (3, 5, 4 * 37 * 2, 3)]
)  # one request's queries split; requests grouped; passes of one request's two queries
def test_indexer_picks_the_top_k_of_the_visible_scores(
    b: int, n: int, floats: int | None, passes: int, monkeypatch
) -> None:
    from daemon.models.deepseek_v4 import attention
    from daemon.models.deepseek_v4.attention import INDEX_CHUNK, Indexer
    from daemon.models.deepseek_v4.batch import EntryTable

    if floats is None:
        assert b * n > INDEX_CHUNK
    else:
        monkeypatch.setattr(attention, "INDEX_FLOATS", floats)
    indexer = Indexer.__new__(Indexer)
    indexer.heads, indexer.dim, indexer.topk = 4, 8, 5
    g = torch.Generator().manual_seed(b)
    e, per_block = 37, 8
    q = torch.randn(b, n, 4, 8, generator=g)
    weights = torch.randn(b, n, 4, generator=g)
    # each request's keys in paged blocks of 8 entries, its blocks in reverse order
    nblocks = -(-e // per_block)
    storage = torch.randn(b * nblocks, per_block, 8, generator=g)
    blocks = torch.arange(b * nblocks).view(b, nblocks).flip(1)
    table = EntryTable(blocks, per_block, e)
    gathered: list[slice] = []  # the requests of each pass
    gather = EntryTable.gather
    monkeypatch.setattr(
        EntryTable, "gather", lambda t, st, req: gathered.append(req) or gather(t, st, req)
    )
    keys = storage[blocks].flatten(1, 2)[:, :e]
    counts = torch.randint(6, e + 1, (b, n), generator=g)
    picks = indexer.select(q, weights, table, storage, counts, seen_by_all=6)
    scores = torch.einsum("bnhd,bed->bnhe", q, keys).relu() * weights[..., None]
    scores = scores.sum(2).masked_fill(torch.arange(e) >= counts[..., None], float("-inf"))
    want = scores.topk(5, dim=-1).indices
    assert len(gathered) == passes
    assert torch.equal(picks.sort(-1).values, want.sort(-1).values)

"""DeepSeek-V4 building blocks: norms, interleaved partial RoPE, hyper-connections,
the grouped output projection and the two MoE kinds with the shared expert."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from daemon.models.deepseek_v4.config import V4Config
from daemon.models.layers import column_major
from daemon.models.rope import inv_freq_and_scaling
from daemon.moe.ep import EPLayer
from kernels import use_triton
from kernels.grouped_linear import grouped_linear_fused, grouped_linear_reference
from kernels.sinkhorn import sinkhorn_fused


class FP32RMSNorm(nn.Module):
    """RMSNorm whose weight stays float32; the product is cast back once."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel: the same float32 formula without the [.., D] temporaries
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class InterleavedRope:
    """RoPE on the trailing `rope_dim` channels, rotating adjacent channel pairs."""

    def __init__(
        self, rope_dim: int, params: dict, max_positions: int, device: torch.device
    ) -> None:
        inv_freq, self.scaling = inv_freq_and_scaling(rope_dim, params, max_positions)
        self.inv_freq = inv_freq.to(device)
        self.rope_dim = rope_dim

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos() * self.scaling, freqs.sin() * self.scaling

    def apply(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
    ) -> torch.Tensor:
        """x: [N, ..., D] with cos/sin [N, rope_dim/2]; heads in between broadcast. Returns a
        new tensor: the pairs are rotated in place in a copy, as complex numbers."""
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
        turn = torch.complex(cos, -sin if inverse else sin).view(shape)
        out = x.clone(memory_format=torch.contiguous_format)
        rope = out[..., -self.rope_dim :]
        pairs = torch.view_as_complex(rope.float().unflatten(-1, (-1, 2)))  # float32: a view
        pairs.mul_(turn)
        if rope.dtype != torch.float32:
            rope.copy_(torch.view_as_real(pairs).flatten(-2))
        return out


def rms_scale(flat: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., C] -> [...]: the factor of a weightless RMSNorm, float32 (one pass, no x^2
    temporary)."""
    norm = torch.linalg.vector_norm(flat, dim=-1, dtype=torch.float32)
    return norm.square_().div_(flat.shape[-1]).add_(eps).rsqrt_()


def sinkhorn(probs: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """probs + eps, then Sinkhorn-normalised: [hc_in, hc_out, T], columns (sums over hc_in)
    first, then `iters - 1` row and column rounds; a view into a bordered buffer.

    Tokens last, so each sum adds hc contiguous rows of T instead of reducing hc-long runs.
    The matrix sits in a buffer with an extra row and column of eps: a sum over the bordered
    rows (columns) is `sum + eps` in one op."""
    hc, _, t = probs.shape
    bordered = probs.new_full((hc + 1, hc + 1, t), eps)
    comb, cols, rows = bordered[:hc, :hc], bordered[:, :hc], bordered[:hc]
    col_sums, row_sums = probs.new_empty(1, hc, t), probs.new_empty(hc, 1, t)
    torch.add(probs, eps, out=comb)
    comb.div_(torch.sum(cols, 0, keepdim=True, out=col_sums))
    for _ in range(iters - 1):
        comb.div_(torch.sum(rows, 1, keepdim=True, out=row_sums))
        comb.div_(torch.sum(cols, 0, keepdim=True, out=col_sums))
    return comb


def weighted_sum(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Σ_n weights[n, t] · values[t, n] for weights [N, T], values [T, N, D] -> [T, D]."""
    # N row-scaled adds: a bmm over T tiny [1, N] x [N, D] products is ~10x slower on CPU
    acc = values[:, 0] * weights[0].unsqueeze(-1)
    for n in range(1, weights.shape[0]):
        acc.addcmul_(values[:, n], weights[n].unsqueeze(-1))
    return acc.to(values.dtype)


class HyperConnection(nn.Module):
    """mHC: collapse hc_mult residual streams into a block input, then mix them back."""

    def __init__(self, cfg: V4Config) -> None:
        super().__init__()
        hc = cfg.hc_mult
        self.hc, self.iters, self.eps, self.norm_eps = (
            hc,
            cfg.hc_sinkhorn_iters,
            cfg.hc_eps,
            cfg.rms_norm_eps,
        )
        self.fn = nn.Parameter(
            torch.empty((2 + hc) * hc, hc * cfg.hidden_size, dtype=torch.float32)
        )
        self.base = nn.Parameter(torch.empty((2 + hc) * hc, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams: [T, hc, D] -> (post [hc, T], comb [hc, hc, T], collapsed [T, D]); post and
        comb are kept tokens-last for `expand`."""
        hc = self.hc
        flat = streams.flatten(1)
        # the norm's per-token factor commutes with the projection: scale its [.., T] output
        mixed = torch.matmul(self.fn.float(), flat.float().T) * rms_scale(flat, self.norm_eps)
        base, scale = self.base.float(), self.scale.float()
        pre_post = torch.addcmul(
            base[: 2 * hc].view(2, hc, 1), mixed[: 2 * hc].view(2, hc, -1), scale[:2].view(2, 1, 1)
        ).sigmoid_()
        pre, post = pre_post[0].add_(self.eps), pre_post[1].mul_(2)
        comb_logits = torch.addcmul(
            base[2 * hc :].view(hc, hc, 1), mixed[2 * hc :].view(hc, hc, -1), scale[2]
        )
        if use_triton(comb_logits.device):
            comb = sinkhorn_fused(comb_logits, self.iters, self.eps)
        else:
            comb = sinkhorn(torch.softmax(comb_logits, dim=1), self.iters, self.eps)
        return post, comb, weighted_sum(pre, streams)

    @staticmethod
    def expand(
        post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor
    ) -> torch.Tensor:
        """New streams [T, hc, D]: post_n * block output + comb^T @ old streams."""
        new = post.T.unsqueeze(-1) * out.unsqueeze(1)
        for n in range(comb.shape[0]):  # as in `weighted_sum`: no bmm over T tiny matrices
            new.addcmul_(comb[n].T.unsqueeze(-1), streams[:, n : n + 1])
        return new.to(streams.dtype)


class HyperHead(nn.Module):
    """Final collapse of the residual streams before the model norm."""

    def __init__(self, cfg: V4Config) -> None:
        super().__init__()
        hc = cfg.hc_mult
        self.eps, self.norm_eps = cfg.hc_eps, cfg.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.empty(hc, hc * cfg.hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.empty(hc, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = streams.flatten(1)
        mixed = torch.matmul(self.hc_fn.float(), flat.float().T) * rms_scale(flat, self.norm_eps)
        pre = torch.addcmul(self.hc_base.float().view(-1, 1), mixed, self.hc_scale.float())
        return weighted_sum(pre.sigmoid_().add_(self.eps), streams)


class GroupedLinear(nn.Module):
    """Block-diagonal projection: each of `groups` input slices has its own weight."""

    def __init__(self, in_per_group: int, out_features: int, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(out_features, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, groups, in_per_group] -> [N, groups, out_features / groups]."""
        w = self.weight.view(self.groups, -1, x.shape[-1]).transpose(1, 2)
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)


def clamped_swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(gate clamped ≤ limit) · up clamped to ±limit; overwrites `gate_up` (a temporary)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.mul(F.silu(gate.clamp_(max=limit), inplace=True), up.clamp_(-limit, limit))


@functools.cache
def _grouped_mm_works(device_type: str) -> bool:
    """Whether `torch._grouped_mm` runs float32 on this kind of device (a private op, not in
    every torch build or backend)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.ones(2, 8, device=device_type)
        offsets = torch.tensor([1, 2], dtype=torch.int32, device=device_type)
        torch._grouped_mm(x, torch.ones(2, 8, 8, device=device_type), offs=offsets)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _grouped_mm_native(x: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` takes `x` on its own kernel. On CUDA that is bf16 only: other
    dtypes fall back to a loop over the groups that reads their ends on the host, which a CUDA
    graph cannot capture (seen on an H200) and the Triton kernel does without."""
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        return False
    return _grouped_mm_works(x.device.type)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """x [N, in] sorted by group, group e = rows ends[e-1]..ends[e] (int32); weight [E, out, in]
    -> [N, out], each group through its own weight. Where torch has no grouped GEMM for the
    device and dtype, CUDA runs the Triton kernel (no host sync: graph-capturable; "meta",
    a shape-only device, its fake) and a CPU one linear per group."""
    if _grouped_mm_native(x):
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=ends)
    if use_triton(x.device):
        return grouped_linear_fused(x, weight, ends)
    return grouped_linear_reference(x, weight, ends)


class SharedExpert(nn.Module):
    def __init__(self, cfg: V4Config) -> None:
        super().__init__()
        self.limit = cfg.swiglu_limit
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.moe_intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.moe_intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_up_proj(x), self.limit))


class Router(nn.Module):
    """Scores sqrt(softplus(x W^T)); `moe` picks top-k by score + correction bias,
    `hash_moe` looks the experts up by input token id. Weights renormalised and scaled."""

    def __init__(self, cfg: V4Config, hashed: bool) -> None:
        super().__init__()
        self.hashed = hashed
        self.top_k, self.scaling = cfg.num_experts_per_tok, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer(
                "tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long)
            )
        else:
            self.register_buffer(
                "e_score_correction_bias", torch.zeros(cfg.num_experts, dtype=torch.float32)
            )

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.softplus(F.linear(x, self.weight)).sqrt()
        if self.hashed:
            experts = self.tid2eid[input_ids].long()
        else:
            experts = torch.topk(
                scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False
            ).indices
        weights = scores.gather(1, experts)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights * self.scaling


# tokens per grouped pass over the experts: bigger passes gain nothing in GEMM rate, and their
# temporaries (several MB) come back from the allocator as fresh pages to fault in (~15 %)
ROUTED_CHUNK = 1024


class MoE(nn.Module):
    def __init__(self, cfg: V4Config, hashed: bool) -> None:
        super().__init__()
        self.num_experts, self.limit = cfg.num_experts, cfg.swiglu_limit
        self.gate = Router(cfg, hashed)
        self.gate_up_proj = nn.Parameter(
            column_major(cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
        )
        self.down_proj = nn.Parameter(
            column_major(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        )
        self.shared_experts = SharedExpert(cfg)
        self.load: torch.Tensor | None = None  # routed (token, expert) pairs since last taken
        self.track_load = True
        self.ep: EPLayer | None = None  # set when the experts are spread over ranks

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor, counted: torch.Tensor | None = None
    ) -> torch.Tensor:
        """counted: [T] 1 for the rows the load statistics count (None: every row)."""
        experts, weights = self.gate(x, input_ids)
        counts = self._bincount(experts)
        if self.track_load:
            self._count(counts if counted is None else self._bincount(experts, counted))
        shared = self.shared_experts(x)
        if self.ep is not None:
            return self.ep.forward(x, experts, weights) + shared
        if x.shape[0] <= ROUTED_CHUNK:
            return self._routed(x, experts, weights, counts).add_(shared)
        for i in range(0, x.shape[0], ROUTED_CHUNK):
            part = slice(i, i + ROUTED_CHUNK)
            chunk_counts = self._bincount(experts[part])
            shared[part] += self._routed(x[part], experts[part], weights[part], chunk_counts)
        return shared

    def _bincount(self, experts: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Pairs per expert, of the rows where `rows` [T] is 1 (default: all); torch.bincount
        would read its input's maximum back on CUDA."""
        flat = experts.flatten()
        ones = torch.ones_like(flat) if rows is None else rows[:, None].expand_as(experts).flatten()
        return flat.new_zeros(self.num_experts).scatter_add_(0, flat, ones)

    def _routed(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """All (token, expert) pairs at once: sorted by expert, one grouped GEMM per
        projection, then each token's k outputs summed with its routing weights."""
        n, k = experts.shape
        flat = experts.flatten()
        order = flat.argsort()
        rows = x[order // k]
        if self._pad_experts(x, counts):
            h = self._padded_experts(rows, flat[order], counts)
        else:
            ends = counts.cumsum(0, dtype=torch.int32)
            h = grouped_linear(rows, self.gate_up_proj, ends)
            h = grouped_linear(clamped_swiglu(h, self.limit), self.down_proj, ends)
        pairs = torch.empty_like(h).index_copy_(0, order, h)  # back to (token, slot) order
        return weighted_sum(weights.T, pairs.view(n, k, -1)).to(x.dtype)

    def _pad_experts(self, x: torch.Tensor, counts: torch.Tensor) -> bool:
        """Decode sizes on a multi-threaded CPU with most experts in use: one small GEMM per
        expert runs on one thread, bound by its weight reads; a bmm over all the experts
        spreads them over the threads (≈1.5x at 2 threads, 64 pairs on 16 experts), which
        pays while the idle experts' weights it also reads stay under a quarter."""
        return (
            x.device.type == "cpu"
            and torch.get_num_threads() > 1
            and x.shape[0] * self.gate.top_k <= 16 * self.num_experts
            and 4 * int(counts.count_nonzero()) >= 3 * self.num_experts
        )

    def _padded_experts(
        self, rows: torch.Tensor, expert_of: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """Rows sorted by expert through their experts, as two bmm over [E, max count, ...]
        zero-padded batches."""
        slot = torch.arange(len(rows), device=rows.device) - (counts.cumsum(0) - counts)[expert_of]
        padded = rows.new_zeros(self.num_experts, int(counts.max()), rows.shape[1])
        padded[expert_of, slot] = rows
        h = torch.bmm(padded, self.gate_up_proj.transpose(1, 2))
        h = torch.bmm(clamped_swiglu(h, self.limit), self.down_proj.transpose(1, 2))
        return h[expert_of, slot]

    def expert(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        return F.linear(clamped_swiglu(F.linear(x, gate_up), self.limit), down)

    def idle_step(self, hidden_size: int, device: torch.device, dtype: torch.dtype) -> None:
        """Take part in the layer's exchange with no tokens of our own (expert parallel)."""
        x = torch.empty(0, hidden_size, device=device, dtype=dtype)
        k = self.gate.top_k
        self.ep.forward(x, torch.empty(0, k, dtype=torch.long, device=device), x.new_empty(0, k))

    def _count(self, counts: torch.Tensor) -> None:
        # in place, in one tensor: a graph replay adds to it too; inference mode, as the
        # counter may have been made in it
        with torch.inference_mode():
            if self.load is None:
                self.load = torch.zeros_like(counts)
            self.load.add_(counts)

    def take_load(self) -> torch.Tensor:
        """Routed pairs per expert since the last call (and start counting again)."""
        if self.load is None:
            return torch.zeros(self.num_experts, dtype=torch.long)
        with torch.inference_mode():
            load = self.load.clone()
            self.load.zero_()
        return load

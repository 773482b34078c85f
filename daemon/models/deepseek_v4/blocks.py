"""DeepSeek-V4 building blocks: norms, interleaved partial RoPE, hyper-connections,
the grouped output projection and the two MoE kinds with the shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from daemon.models.deepseek_v4.config import V4Config
from daemon.models.rope import inv_freq_and_scaling
from daemon.moe.ep import EPLayer


class FP32RMSNorm(nn.Module):
    """RMSNorm whose weight stays float32; the product is cast back once."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


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
        """x: [N, ..., D] with cos/sin [N, rope_dim/2]; heads in between broadcast."""
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
        cos, sin = cos.view(shape), sin.view(shape)
        if inverse:
            sin = -sin
        rope = x[..., -self.rope_dim :].float()
        even, odd = rope[..., 0::2], rope[..., 1::2]
        rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
        return torch.cat((x[..., : -self.rope_dim], rotated.to(x.dtype)), dim=-1)


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
        """streams: [T, hc, D] -> (post [T, hc], comb [T, hc, hc], collapsed [T, D])."""
        hc = self.hc
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixed = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixed.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([hc, hc, hc * hc])
        pre_s, post_s, comb_s = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = (
            torch.softmax(comb_w.view(-1, hc, hc) * comb_s + comb_b.view(hc, hc), dim=-1) + self.eps
        )
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def expand(
        post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor
    ) -> torch.Tensor:
        """New streams: post_n * block output + comb^T @ old streams."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(1) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams
        )


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
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        pre = torch.sigmoid(
            F.linear(flat, self.hc_fn.float()) * self.hc_scale.float() + self.hc_base.float()
        )
        return ((pre + self.eps).unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


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
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


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


class MoE(nn.Module):
    def __init__(self, cfg: V4Config, hashed: bool) -> None:
        super().__init__()
        self.num_experts, self.limit = cfg.num_experts, cfg.swiglu_limit
        self.gate = Router(cfg, hashed)
        self.gate_up_proj = nn.Parameter(
            torch.empty(cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
        )
        self.down_proj = nn.Parameter(
            torch.empty(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        )
        self.shared_experts = SharedExpert(cfg)
        self.load: torch.Tensor | None = None  # routed (token, expert) pairs since last taken
        self.track_load = True
        self.ep: EPLayer | None = None  # set when the experts are spread over ranks

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        experts, weights = self.gate(x, input_ids)
        flat = experts.flatten()
        counts = torch.bincount(flat, minlength=self.num_experts)
        self._count(counts)
        if self.ep is not None:
            return self.ep.forward(x, experts, weights) + self.shared_experts(x)
        out = torch.zeros_like(x)
        order = flat.argsort(stable=True)
        token_of = order // experts.shape[1]
        weight_of = weights.flatten()[order]
        begin = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            tokens = token_of[begin : begin + n]
            h = self.expert(x[tokens], self.gate_up_proj[e], self.down_proj[e])
            out.index_add_(0, tokens, (h * weight_of[begin : begin + n, None]).to(out.dtype))
            begin += n
        return out + self.shared_experts(x)

    def expert(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        return F.linear(clamped_swiglu(F.linear(x, gate_up), self.limit), down)

    def idle_step(self, hidden_size: int, device: torch.device, dtype: torch.dtype) -> None:
        """Take part in the layer's exchange with no tokens of our own (expert parallel)."""
        x = torch.empty(0, hidden_size, device=device, dtype=dtype)
        k = self.gate.top_k
        self.ep.forward(x, torch.empty(0, k, dtype=torch.long, device=device), x.new_empty(0, k))

    def _count(self, counts: torch.Tensor) -> None:
        if not self.track_load:
            return
        if self.load is None:
            self.load = torch.zeros_like(counts)
        self.load += counts

    def take_load(self) -> torch.Tensor:
        """Routed pairs per expert since the last call (and start counting again)."""
        load = (
            self.load if self.load is not None else torch.zeros(self.num_experts, dtype=torch.long)
        )
        self.load = torch.zeros_like(load)
        return load

"""DeepSeek-V4's multi-token-prediction (MTP) layer as a draft network: built from the `mtp.*`
tensors the loader keeps, with its own sliding-window ring per request.

Sources (read, not copied): DeepSeek's own V4 inference `model.py` (`MTPBlock`, as stored in
forks of it) and vLLM's `deepseek_v4_mtp.py`. Both agree on the structure:
  e = enorm(embed(next token)); h = hnorm(target streams), per residual stream
  streams = e_proj(e) (broadcast to every stream) + h_proj(h)
  streams = one full V4 block (mHC around attention and MoE) at layer id num_layers
  logits = shared lm_head(norm(hc_head(streams)))  -- the MTP's own hc_head_* and norm
The target's streams are its last layer's output before the head's collapse (what our
forward returns); an MTP pass's own output streams feed the next chained pass. The block's
attention kind is `compress_ratios[num_layers]` of the config (`V4Config.mtp_layer_type`; 0 in
V4-Flash's 44 entries for 43 layers: sliding window only, RoPE at base theta; no compressor or indexer tensors exist
under `mtp.0.` in the released checkpoint) and its MoE is score-routed (`ffn.gate.bias`).
vLLM also zeroes the embedding at position 0; DeepSeek's reference does not, nor do we.
The checkpoint's embedding and head under `mtp.N.` (if any) are ignored: both are shared.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from daemon.models.base import SeqSlice
from daemon.models.deepseek_v4.batch import ChunkQueries, V4Batch, V4Decodes, V4SeqMeta
from daemon.models.deepseek_v4.blocks import FP32RMSNorm, HyperHead, InterleavedRope
from daemon.models.deepseek_v4.config import SLIDING, V4Config
from daemon.models.deepseek_v4.kv import ring_size
from daemon.models.deepseek_v4.model import DeepseekV4ForCausalLM, V4DecoderLayer
from daemon.models.deepseek_v4.weights import checkpoint_target, mtp_weights

# the MTP layer's own tensors (checkpoint name after `mtp.N.`) -> our parameter
_OWN = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "e_proj.weight": "e_proj.weight",
    "h_proj.weight": "h_proj.weight",
    "norm.weight": "norm.weight",
    "hc_head_fn": "hc_head.hc_fn",
    "hc_head_base": "hc_head.hc_base",
    "hc_head_scale": "hc_head.hc_scale",
}
_SHARED = ("emb.tok_emb.weight", "embed.weight", "embed_tokens.weight", "head.weight")


@dataclass
class MTPCache:
    """The MTP layer's raw KV: one ring per request, indexed by the request's sliding-window
    block (the target's), so the target's block tables address it. Shaped as the target's
    rings (W-1+B rows), so a draft pass's writes past the accepted position only evict
    positions older than every window still read (for fewer than B drafts)."""

    swa: dict[int, torch.Tensor]  # {the MTP layer id: [swa blocks + 1, ring, head_dim]}
    ring: int
    layers: dict = field(default_factory=dict)  # no compressed layers: V4Attention reads these
    indexers: dict = field(default_factory=dict)

    @classmethod
    def allocate(
        cls, cfg: V4Config, layer: int, swa_blocks: int, device: torch.device, dtype: torch.dtype
    ) -> MTPCache:
        ring = ring_size(cfg)
        rings = {layer: torch.zeros(swa_blocks + 1, ring, cfg.head_dim, dtype=dtype, device=device)}
        return cls(rings, ring)


class MTPLayer(nn.Module):
    """One MTP layer over the engine's flat token batch; embedding and lm_head are the
    target's."""

    def __init__(self, cfg: V4Config, target: DeepseekV4ForCausalLM, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer = cfg.num_layers  # its layer id, as in DeepSeek's reference
        block_cfg = dataclasses.replace(
            cfg,
            layer_types=[*cfg.layer_types, SLIDING],
            mlp_layer_types=[*cfg.mlp_layer_types, "moe"],
        )
        with torch.device("cpu"):
            rope = InterleavedRope(cfg.rope_dim, cfg.rope_main, cfg.max_position_embeddings, device)
            rope_compress = InterleavedRope(
                cfg.rope_dim, cfg.rope_compress, cfg.max_position_embeddings, device
            )
        d = cfg.hidden_size
        self.enorm = FP32RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = FP32RMSNorm(d, cfg.rms_norm_eps)
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.block = V4DecoderLayer(block_cfg, self.layer, rope, rope_compress)
        self.block.mlp.track_load = False  # the MoE statistics are the target's layers'
        self.hc_head = HyperHead(cfg)
        self.norm = FP32RMSNorm(d, cfg.rms_norm_eps)
        # shared, not owned: kept out of this module's parameters
        self._shared = (target.embed_tokens, target.lm_head)

    def forward(
        self,
        streams: torch.Tensor,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: V4Batch,
        cache: MTPCache,
    ) -> torch.Tensor:
        """streams [T, hc, D] (the target's at these positions, or the previous pass's) and
        the token after each position -> this layer's streams [T, hc, D]; writes its KV."""
        embed, _ = self._shared
        e = self.e_proj(self.enorm(embed(next_ids)))
        x = self.h_proj(self.hnorm(streams)) + e.unsqueeze(1)
        return self.block(x.to(streams.dtype), next_ids, positions, batch, cache)

    def compute_logits(self, streams: torch.Tensor) -> torch.Tensor:
        _, lm_head = self._shared
        return lm_head(self.norm(self.hc_head(streams))).float()


def build_mtp(target: DeepseekV4ForCausalLM, index: int = 0) -> MTPLayer:
    """MTP layer `index` from the target's kept `mtp.*` tensors (ValueError where the
    checkpoint has none, or lacks some, or holds one of a wrong shape)."""
    cfg = target.cfg
    prefix = f"mtp.{index}."
    weights = {
        k[len(prefix) :]: v for k, v in mtp_weights(target.mtp).items() if k.startswith(prefix)
    }
    if not weights:
        raise ValueError(f"the checkpoint has no {prefix}* tensors (no MTP layer {index})")
    if cfg.mtp_layer_type != SLIDING:
        raise ValueError(
            f"MTP layers of kind {cfg.mtp_layer_type!r} are not supported (sliding window only)"
        )
    like = target.embed_tokens.weight
    previous = torch.get_default_dtype()
    torch.set_default_dtype(like.dtype)  # float32 where the model declares it, as the loader
    try:
        with torch.device("meta"):
            layer = MTPLayer(cfg, target, like.device)
    finally:
        torch.set_default_dtype(previous)
    layer.to_empty(device=like.device)
    params = dict(layer.named_parameters()) | dict(layer.named_buffers())
    expected = {
        (name, part)
        for name in params
        for part in (target.param_parts(name) if name.startswith("block.") else [None])
    }
    filled: set = set()
    block = f"layers.{layer.layer}."
    for rest, tensor in weights.items():
        if rest in _SHARED:
            continue
        if rest in _OWN:
            name, part = _OWN[rest], None
        else:
            mapped = checkpoint_target(block + rest, cfg)
            if mapped is None:
                continue
            name, part = "block." + mapped[0][len(block) :], mapped[1]
        if name not in params:
            raise ValueError(f"unexpected MTP tensor {prefix}{rest}")
        view = target.param_view(name, params[name].data, part)
        if tuple(view.shape) != tuple(tensor.shape):
            raise ValueError(
                f"MTP tensor {prefix}{rest} has shape {tuple(tensor.shape)}, "
                f"the layer expects {tuple(view.shape)}"
            )
        with torch.no_grad():
            view.copy_(tensor.to(view.dtype))
        filled.update((name, p) for p in target.covered_parts(name, part))
    missing = sorted(f"{n}{'' if p is None else p}" for n, p in expected - filled)
    if missing:
        raise ValueError(f"the checkpoint's MTP layer {index} lacks: {', '.join(missing[:8])}")
    return layer.requires_grad_(False).eval()


def window_batch(cfg: V4Config, ring: int, slices: list[SeqSlice], swa_group: int) -> V4Batch:
    """Attention metadata of a step for the MTP layer: windows only (its layer has no
    compressed entries), over the rings of the requests' sliding-window blocks."""
    batch = V4Batch()
    for s in slices:
        batch.seqs.append(
            V4SeqMeta(
                q_start=s.q_start,
                start=s.start,
                num_tokens=s.num_tokens,
                swa_block=s.block_tables[swa_group][0],
                state_block=-1,
                csa_table=[],
                hca_table=[],
                replay=s.replay,
                window_floor=s.window_floor,
            )
        )
    chunks = batch.chunks
    if chunks:
        batch.queries = ChunkQueries.build(chunks, cfg, ring, {})
    decodes = [s for s in batch.seqs if s.is_decode]
    if decodes:
        batch.decodes = _window_decodes(cfg, ring, decodes)
    return batch


def _window_decodes(cfg: V4Config, ring: int, seqs: list[V4SeqMeta]) -> V4Decodes:
    w = cfg.sliding_window
    pos = torch.tensor([s.start for s in seqs], dtype=torch.long)
    swa = torch.tensor([s.swa_block for s in seqs], dtype=torch.long)
    window = pos[:, None] + torch.arange(1 - w, 1)
    padding = window < 0
    return V4Decodes(
        rows=torch.tensor([s.q_start for s in seqs], dtype=torch.long),
        new_rows=swa * ring + pos % ring,
        window_rows=swa[:, None] * ring + window.clamp(min=0) % ring,
        window_padding=padding if bool(padding.any()) else None,
        state_blocks=torch.full((len(seqs),), -1, dtype=torch.long),
    )

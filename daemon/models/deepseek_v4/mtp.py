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

from daemon.kv.spec import KVGroup
from daemon.models.base import SeqSlice
from daemon.models.deepseek_v4.batch import ChunkQueries, V4Batch, V4Decodes, V4SeqMeta
from daemon.models.deepseek_v4.blocks import FP32RMSNorm, HyperHead, InterleavedRope
from daemon.models.deepseek_v4.config import SLIDING, V4Config
from daemon.models.deepseek_v4.kv import V4Groups, ring_size
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
    """The MTP layer's state, per request, indexed by the request's sliding-window block (the
    target's), so the target's block tables address it: its raw KV ring, shaped as the
    target's (W-1+B rows: a draft pass's writes past the accepted position only evict
    positions older than every window still read, for fewer than B drafts), and the target's
    output streams at its last few positions (an entry needs the one before its own).

    Positions are the target's token positions: the entry at p is the MTP pass over the
    target's streams at p-1 and the token at p (DeepSeek's reference puts it at p-1; RoPE's
    relative angles make the two the same). Position 0 has no entry: windows start at 1."""

    cfg: V4Config
    swa: dict[int, torch.Tensor]  # {the MTP layer id: [swa blocks + 1, ring, head_dim]}
    ring: int
    hidden: torch.Tensor  # [swa blocks + 1, H, hc, D] the target's streams at positions p % H
    swa_group: int  # the sliding-window group's index in the target's block tables
    layers: dict = field(default_factory=dict)  # no compressed layers: V4Attention reads these
    indexers: dict = field(default_factory=dict)

    @classmethod
    def allocate(
        cls,
        cfg: V4Config,
        layer: int,
        swa_blocks: int,
        device: torch.device,
        dtype: torch.dtype,
        positions_kept: int = 2,
        swa_group: int = 0,
    ) -> MTPCache:
        """`positions_kept`: the target streams kept per request, more than the rows a verify
        computes (drafts + 1), so a recompute after a rollback finds the one before it."""
        ring = ring_size(cfg)
        rings = {layer: torch.zeros(swa_blocks + 1, ring, cfg.head_dim, dtype=dtype, device=device)}
        hidden = torch.zeros(
            swa_blocks + 1, positions_kept, cfg.hc_mult, cfg.hidden_size, dtype=dtype, device=device
        )
        return cls(cfg, rings, ring, hidden, swa_group)

    @staticmethod
    def bytes_per_request(cfg: V4Config, dtype: torch.dtype, positions_kept: int) -> int:
        """Device bytes of one request's state (a ring and the streams kept)."""
        item = torch.empty((), dtype=dtype).element_size()
        return (
            ring_size(cfg) * cfg.head_dim + positions_kept * cfg.hc_mult * cfg.hidden_size
        ) * item

    def build_attention(self, seqs: list[SeqSlice]) -> V4Batch:
        """The metadata of one-token draft passes (or any slices) over these rings."""
        metas = [
            V4SeqMeta(
                q_start=s.q_start,
                start=s.start,
                num_tokens=s.num_tokens,
                swa_block=s.block_tables[self.swa_group][0],
                state_block=-1,
                csa_table=[],
                hca_table=[],
                replay=s.replay,
                window_floor=s.window_floor,
            )
            for s in seqs
        ]
        return window_batch(self.cfg, self.ring, metas)


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
        """streams [T, hc, D] (the target's at the position before each row's, or the previous
        pass's output) and the token at each row's position -> this layer's streams [T, hc, D]
        (`compute_logits` of them: the token after); writes its KV at `positions` (all ≥ 1)."""
        embed, _ = self._shared
        e = self.e_proj(self.enorm(embed(next_ids)))
        x = self.h_proj(self.hnorm(streams)) + e.unsqueeze(1)
        return self.block(x.to(streams.dtype), next_ids, positions, batch, cache)

    def compute_logits(self, streams: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """fp32 logits (`upcast` or not) of the rows' streams."""
        _, lm_head = self._shared
        return lm_head(self.norm(self.hc_head(streams))).float()


class MTPDraftNetwork:
    """The MTP layer as the runner's draft network (loop/early_exit.py `DraftNetwork`): its
    state in an `MTPCache`. `mirror` makes, after each target forward, the entries of every
    position the step computed, from the target's streams at the position before (kept from
    the step before for its first row) and the token there: so a draft pass always finds the
    window of entries the accepted tokens give. A verify's rows past its accepted drafts, and
    chained draft passes, leave entries of tokens that may be rejected: the next step's
    mirror, or its first draft pass, writes them again before any query reads them.

    Where the prefix cache restores a window or blocks (host tier, block store, a SWA
    snapshot), the MTP state of those positions is not restored: it is whatever the ring held.
    That lowers acceptance for such requests, never the output (the target verifies)."""

    def __init__(self, layer: MTPLayer, cache: MTPCache) -> None:
        self.layer = layer
        self.mtp_cache = cache

    @classmethod
    def allocate(
        cls,
        layer: MTPLayer,
        groups: list[KVGroup],
        num_blocks: list[int],
        device: torch.device,
        spec_tokens: int,
    ) -> MTPDraftNetwork:
        """Its state for the target's KV groups and pool sizes (one ring per sliding-window
        block), keeping the target's streams of more positions than a verify computes."""
        swa = V4Groups.of(layer.cfg, groups).swa
        dtype = layer.e_proj.weight.dtype
        cache = MTPCache.allocate(
            layer.cfg, layer.layer, num_blocks[swa], device, dtype, spec_tokens + 2, swa
        )
        return cls(layer, cache)

    @property
    def cache(self) -> MTPCache:
        return self.mtp_cache

    def mirror(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: V4Batch,
        hidden: torch.Tensor,
    ) -> None:
        """The entries of the step's positions (but 0) from its rows: `hidden` [T, hc, D] the
        target's output streams, `attention` its metadata (the sequences' rows)."""
        c, dev = self.mtp_cache, hidden.device
        kept = c.hidden.shape[1]
        ring = c.hidden.view(-1, *c.hidden.shape[2:])
        metas: list[V4SeqMeta] = []
        rows: list[int] = []  # the step's rows computed, in the MTP batch's order
        before: list[int] = []  # the step's row of the position before each (0: see `firsts`)
        firsts: list[int] = []  # entries whose position before is the step before's
        kept_at: list[int] = []  # ... and where its streams are kept
        store_rows: list[int] = []
        store_at: list[int] = []
        for s in attention.seqs:
            base, end = s.swa_block * kept, s.start + s.num_tokens
            keep = range(max(s.start, end - kept), end)
            store_rows += [s.q_start + p - s.start for p in keep]
            store_at += [base + p % kept for p in keep]
            first = max(s.start, 1)
            if first >= end:
                continue
            q = len(rows)
            metas.append(dataclasses.replace(s, q_start=q, start=first, num_tokens=end - first))
            rows += range(s.q_start + first - s.start, s.q_start + s.num_tokens)
            before += [max(s.q_start + p - 1 - s.start, 0) for p in range(first, end)]
            if first == s.start:
                firsts.append(q)
                kept_at.append(base + (first - 1) % kept)

        def index(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=dev)

        if metas:
            streams = hidden[index(before)]
            if firsts:
                streams[index(firsts)] = ring[index(kept_at)]
            take = index(rows)
            batch = window_batch(c.cfg, c.ring, metas).to(dev)
            self.layer(streams, input_ids[take], positions[take], batch, c)
        if store_rows:
            ring.index_copy_(0, index(store_at), hidden[index(store_rows)])

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: V4Batch,
        context: torch.Tensor,
    ) -> torch.Tensor:
        """A draft pass: the token at each position and `context`, the streams of the position
        before (the target's, then the previous pass's)."""
        return self.layer(context, input_ids, positions, attention, self.mtp_cache)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.layer.compute_logits(hidden)


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


def window_batch(cfg: V4Config, ring: int, seqs: list[V4SeqMeta]) -> V4Batch:
    """Attention metadata for the MTP layer: windows only (its layer has no compressed
    entries), over the rings of the requests' sliding-window blocks; position 0 is never
    seen (no entry there), nor computed (callers start at 1)."""
    batch = V4Batch(
        seqs=[dataclasses.replace(s, window_floor=max(s.window_floor, 1)) for s in seqs]
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
    floor = torch.tensor([s.window_floor for s in seqs], dtype=torch.long)
    padding = window < floor[:, None]
    return V4Decodes(
        rows=torch.tensor([s.q_start for s in seqs], dtype=torch.long),
        new_rows=swa * ring + pos % ring,
        window_rows=swa[:, None] * ring + window.clamp(min=0) % ring,
        window_padding=padding if bool(padding.any()) else None,
        state_blocks=torch.full((len(seqs),), -1, dtype=torch.long),
    )

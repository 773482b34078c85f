"""DeepSeek-V4 KV state as KV groups of the engine's manager, and one compressor's storage."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from daemon.kv.spec import (
    CompressedKVSpec,
    CompressorStateSpec,
    KVGroup,
    KVSpec,
    SlidingWindowSpec,
)
from daemon.models.deepseek_v4.config import CSA, HCA, V4Config

SWA, STATE = "swa", "state"  # the per-request groups' labels (/metrics' `kind`)


def ring_size(cfg: V4Config) -> int:
    return cfg.sliding_window - 1 + cfg.block_tokens


def kv_groups(cfg: V4Config, dtype: torch.dtype) -> list[KVGroup]:
    """The V4 groups. Per request (fixed size, one block each):
      swa    ring of the last W-1+B raw KV per layer (B = prefix block tokens), so the
             sliding state at the last block boundary is still there when a request ends
      state  compressor open-window buffers and the CSA overlap (Ca of the last window)
    Paged, one block per B tokens (B = lcm of the compress rates, 128 for real configs):
      csa    B/4 compressed entries + B/4 indexer keys per CSA layer, and the overlap
             state at the block's end (what a resume from this boundary needs)
      hca    B/128 compressed entries per HCA layer
    The cache gives every tensor one scratch row past the pool's (a ring, a state block, a
    paged block): the idle rows of a CUDA-graph decode batch, and windows that close nothing
    there, write to it."""
    item = torch.empty((), dtype=dtype).element_size()
    hd, ihd, B = cfg.head_dim, cfg.index_head_dim, cfg.block_tokens
    csa, hca = cfg.layers_of(CSA), cfg.layers_of(HCA)
    m, mh = cfg.csa_rate, cfg.hca_rate
    all_layers = tuple(range(cfg.num_layers))
    groups = [
        KVGroup(
            SlidingWindowSpec(
                B, cfg.num_layers, dtype, SWA, ring_size(cfg) * hd * item * cfg.num_layers
            ),
            all_layers,
        )
    ]
    # buffers: kv and gate of up to m tokens (2 series for CSA and its indexer); overlap: Ca kv + gate
    csa_state = 2 * m * 2 * (hd + ihd) + 2 * m * (hd + ihd)
    hca_state = 2 * mh * hd
    state_floats = csa_state * len(csa) + hca_state * len(hca)
    if state_floats:
        groups.append(
            KVGroup(
                CompressorStateSpec(B, len(csa) + len(hca), torch.float32, STATE, state_floats * 4),
                tuple(csa + hca),
            )
        )
    if csa:
        per_block = (B // m) * (hd + ihd) * item + 2 * m * (hd + ihd) * 4
        groups.append(
            KVGroup(CompressedKVSpec(B, len(csa), dtype, CSA, per_block * len(csa)), tuple(csa))
        )
    if hca:
        groups.append(
            KVGroup(
                CompressedKVSpec(B, len(hca), dtype, HCA, (B // mh) * hd * item * len(hca)),
                tuple(hca),
            )
        )
    return groups


@dataclass(frozen=True)
class V4Groups:
    """Where each V4 group is in the engine's group list, found by spec class (CSA and HCA,
    both compressed, by their layers); None where the model has no such layers."""

    swa: int
    state: int | None
    csa: int | None
    hca: int | None

    @classmethod
    def of(cls, cfg: V4Config, groups: list[KVGroup]) -> V4Groups:
        def find(spec: type[KVSpec], layers: list[int] | None = None) -> int | None:
            for i, g in enumerate(groups):
                if isinstance(g.spec, spec) and (layers is None or g.layer_ids == tuple(layers)):
                    return i
            return None

        swa = find(SlidingWindowSpec)
        if swa is None:
            raise ValueError("a DeepSeek-V4 cache needs its sliding-window group")
        return cls(
            swa,
            find(CompressorStateSpec),
            find(CompressedKVSpec, cfg.layers_of(CSA)),
            find(CompressedKVSpec, cfg.layers_of(HCA)),
        )

    @property
    def paged(self) -> dict[str, int]:
        """The paged groups present, by layer kind (CSA, HCA)."""
        kinds = {CSA: self.csa, HCA: self.hca}
        return {kind: i for kind, i in kinds.items() if i is not None}


@dataclass
class CompressorState:
    """One compressed layer's (or indexer's) storage; rows indexed by state block or paged block."""

    buf_kv: torch.Tensor  # [state blocks, m, C]  projected kv of the open window
    buf_gate: torch.Tensor  # [state blocks, m, C]  raw gate (+ position bias) of the open window
    entries: torch.Tensor  # [paged blocks, B/m, dim]  compressed entries, RoPE applied
    ovl_kv: torch.Tensor | None = None  # [state blocks, m, dim]  CSA: Ca of the last closed window
    ovl_gate: torch.Tensor | None = None
    block_ovl_kv: torch.Tensor | None = None  # [paged blocks, m, dim]  overlap at each block's end
    block_ovl_gate: torch.Tensor | None = None

"""DeepSeek-V4 KV storage on the device (sliding-window rings, compressor state, compressed
entries) and the per-step metadata built from it; the layout is in `kv.py`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from daemon.kv.spec import KVGroup
from daemon.models.base import KVExport, RequestState
from daemon.models.deepseek_v4.batch import (
    ChunkQueries,
    ChunkWindows,
    DecodeEntries,
    DecodeShape,
    V4Batch,
    V4Decodes,
    V4SeqMeta,
)
from daemon.models.deepseek_v4.config import CSA, HCA, V4Config
from daemon.models.deepseek_v4.kv import CompressorState, V4Groups, ring_size
from daemon.models.kv_transfer import export_blocks, import_blocks


class V4Cache:
    """Every group's storage (`kv.py` has the layout) and the per-step metadata over it.
    A request's per-request state is its ring (every layer) and its compressors' state block
    (open-window buffers, CSA overlap); its paged blocks hold the compressed entries."""

    def __init__(
        self,
        cfg: V4Config,
        groups: list[KVGroup],
        num_blocks: list[int],
        device: torch.device,
        decode_shape: Callable[[int, int], DecodeShape | None] | None = None,
    ) -> None:
        """`decode_shape` (with decode graphs): (decodes, context) -> the shape a decode-only
        step of that many requests, all positions below context, is padded to; None where
        none fits."""
        g = self.groups = V4Groups.of(cfg, groups)
        self.kinds = g.paged  # the paged groups, by layer kind
        dtype = groups[g.swa].spec.dtype
        self.cfg = cfg
        self.ring = ring_size(cfg)
        # compressed entries per paged block, by kind
        self.per_block = {k: cfg.block_tokens // r for k, r in cfg.compress_rates.items()}
        # the scratch rows: one past each pool
        self.scratch_swa = num_blocks[g.swa]
        self.scratch_state = num_blocks[g.state] if g.state is not None else 0
        self.scratch_block = {kind: num_blocks[i] for kind, i in self.kinds.items()}
        self.decode_shape = decode_shape
        self.swa = [
            torch.zeros(self.scratch_swa + 1, self.ring, cfg.head_dim, dtype=dtype, device=device)
            for _ in range(cfg.num_layers)
        ]
        self.layers: dict[int, CompressorState] = {}
        self.indexers: dict[int, CompressorState] = {}
        n_state = self.scratch_state + 1
        B, hd, ihd = cfg.block_tokens, cfg.head_dim, cfg.index_head_dim

        def state(m: int, c: int, dim: int, n_paged: int, overlap: bool) -> CompressorState:
            f32 = dict(dtype=torch.float32, device=device)
            n_paged += 1
            s = CompressorState(
                buf_kv=torch.zeros(n_state, m, c, **f32),
                buf_gate=torch.zeros(n_state, m, c, **f32),
                entries=torch.zeros(n_paged, B // m, dim, dtype=dtype, device=device),
            )
            if overlap:
                s.ovl_kv = torch.zeros(n_state, m, dim, **f32)
                s.ovl_gate = torch.full((n_state, m, dim), float("-inf"), **f32)
                s.block_ovl_kv = torch.zeros(n_paged, m, dim, **f32)
                s.block_ovl_gate = torch.full((n_paged, m, dim), float("-inf"), **f32)
            return s

        for layer in cfg.layers_of(CSA):
            n_csa = self.scratch_block[CSA]
            self.layers[layer] = state(cfg.csa_rate, 2 * hd, hd, n_csa, True)
            self.indexers[layer] = state(cfg.csa_rate, 2 * ihd, ihd, n_csa, True)
        for layer in cfg.layers_of(HCA):
            self.layers[layer] = state(cfg.hca_rate, hd, hd, self.scratch_block[HCA], False)

    def block_views(self, group: int) -> list[torch.Tensor]:
        """The tensors of paged group `group` (csa or hca), indexed by block on dim 0; the
        scratch block is left out."""
        kind = next(k for k, i in self.kinds.items() if i == group)
        pool = self.scratch_block[kind]
        views: list[torch.Tensor] = []
        for layer in self.cfg.layers_of(kind):
            for st in (self.layers[layer], self.indexers.get(layer)):
                if st is None:
                    continue
                views.append(st.entries[:pool])
                if st.block_ovl_kv is not None:
                    views += [st.block_ovl_kv[:pool], st.block_ovl_gate[:pool]]
        return views

    def build_attention(self, seqs) -> V4Batch:
        g = self.groups
        batch = V4Batch()
        for s in seqs:
            tables = s.block_tables
            meta = V4SeqMeta(
                q_start=s.q_start,
                start=s.start,
                num_tokens=s.num_tokens,
                swa_block=tables[g.swa][0],
                state_block=tables[g.state][0] if g.state is not None else -1,
                csa_table=tables[g.csa] if g.csa is not None else [],
                hca_table=tables[g.hca] if g.hca is not None else [],
                replay=s.replay,
                window_floor=s.window_floor,
                fresh=s.start == 0 and not s.replay,
            )
            batch.seqs.append(meta)
        fresh = [s.state_block for s in batch.seqs if s.fresh]
        if fresh and g.state is not None:
            batch.fresh_states = torch.tensor(fresh, dtype=torch.long)
        chunks = batch.chunks
        if chunks:
            kinds = {k: n for k, n in self.per_block.items() if k in self.kinds}
            batch.queries = ChunkQueries.build(chunks, self.cfg, self.ring, kinds)
        fed = [s for s in chunks if not s.replay]
        if fed:
            for kind in self.kinds:
                tables = [s.csa_table if kind == CSA else s.hca_table for s in fed]
                batch.compression[kind] = ChunkWindows.build(
                    fed, tables, self.cfg.compress_rates[kind], self.per_block[kind]
                )
        decodes = [s for s in batch.seqs if s.is_decode]
        if decodes:
            # a graph's decodes: none starts a request (its state is reset first, eagerly)
            graphed = self.decode_shape is not None and len(decodes) == len(batch.seqs)
            if graphed and not any(s.fresh for s in decodes):
                batch.shape = self.decode_shape(len(decodes), max(s.start for s in decodes) + 1)
            batch.decodes = self._decodes(decodes, batch.shape)
        return batch

    def _decodes(self, seqs: list[V4SeqMeta], shape: DecodeShape | None) -> V4Decodes:
        """The decodes' metadata; with a shape, padded to it: idle rows write their token to
        the scratch ring and state block, and see no key but the sink."""
        w, ring = self.cfg.sliding_window, self.ring
        q_rows = [s.q_start for s in seqs]
        first = q_rows[0] if q_rows else 0
        contiguous = q_rows == list(range(first, first + len(seqs)))
        positions = [s.start for s in seqs]
        idle = 0 if shape is None else shape.batch - len(seqs)
        pos = torch.tensor(positions + [0] * idle, dtype=torch.long)
        swa = torch.tensor([s.swa_block for s in seqs] + [self.scratch_swa] * idle)
        window = pos[:, None] + torch.arange(1 - w, 1)
        padding = window < 0
        padding[len(seqs) :] = True
        state_blocks = torch.tensor([s.state_block for s in seqs] + [self.scratch_state] * idle)
        decodes = V4Decodes(
            rows=slice(first, first + len(seqs) + idle) if contiguous else torch.tensor(q_rows),
            new_rows=swa * ring + pos % ring,
            window_rows=swa[:, None] * ring + window.clamp(min=0) % ring,
            window_padding=padding if shape is not None or min(positions) < w - 1 else None,
            state_blocks=state_blocks,
        )
        for kind in self.kinds:
            tables = [s.csa_table if kind == CSA else s.hca_table for s in seqs]
            rate, per_block = self.cfg.compress_rates[kind], self.per_block[kind]
            decodes.entries[kind] = (
                DecodeEntries.build(tables, positions, state_blocks, rate, per_block)
                if shape is None
                else DecodeEntries.build_padded(
                    tables,
                    positions,
                    state_blocks,
                    rate,
                    per_block,
                    shape,
                    self.scratch_block[kind],
                )
            )
        return decodes

    def idle_decodes(self, shape: DecodeShape) -> V4Decodes:
        """Decode metadata of `shape` with every row idle: all its writes go to scratch rows."""
        return self._decodes([], shape)

    def reset_requests(self, state_blocks: torch.Tensor) -> None:
        """New requests took these state blocks: no open windows, no overlap yet."""
        for st in list(self.layers.values()) + list(self.indexers.values()):
            if st.ovl_kv is not None:
                st.ovl_kv.index_fill_(0, state_blocks, 0.0)
                st.ovl_gate.index_fill_(0, state_blocks, float("-inf"))

    # ---- prefix reuse ----------------------------------------------------------------------

    @property
    def replay_tokens(self) -> int:
        """Tokens a replay recomputes to rebuild the window exactly: layer k's keys before a
        boundary need layer k-1's outputs over W-1 more positions, down to the first layer's,
        which need only their tokens."""
        return self.cfg.num_layers * (self.cfg.sliding_window - 1)

    @property
    def swa_snapshot_bytes(self) -> int:
        t = self.swa[0]
        return self.cfg.num_layers * (self.cfg.sliding_window - 1) * t.shape[-1] * t.element_size()

    def _window_before(self, position: int) -> torch.Tensor:
        first = max(0, position - (self.cfg.sliding_window - 1))
        return torch.arange(first, position, device=self.swa[0].device) % self.ring

    def save_swa(self, swa_block: int, position: int) -> torch.Tensor:
        """The raw KV of the W-1 positions before `position`, every layer, in host memory."""
        idx = self._window_before(position)
        return torch.stack([ring[swa_block, idx] for ring in self.swa]).to("cpu", copy=True)

    def restore(self, op, tables: list[list[int]]) -> None:
        """Per-request state at a block boundary: the window (if stored) and the CSA overlap."""
        g = self.groups
        swa_block = tables[g.swa][0]
        if op.snapshot is not None:
            idx = self._window_before(op.position)
            snap = op.snapshot.tensor.to(self.swa[0].device)
            for layer, ring in enumerate(self.swa):
                ring[swa_block, idx] = snap[layer]
        if g.state is None or g.csa is None:
            return
        state_block = tables[g.state][0]
        boundary_block = tables[g.csa][op.position // self.cfg.block_tokens - 1]
        for layer in self.cfg.layers_of(CSA):
            for st in (self.layers[layer], self.indexers[layer]):
                st.ovl_kv[state_block] = st.block_ovl_kv[boundary_block]
                st.ovl_gate[state_block] = st.block_ovl_gate[boundary_block]

    # ---- per-request state: rollback and transfer ------------------------------------------

    @property
    def paged_groups(self) -> list[int]:
        return list(self.kinds.values())

    def _request_state(self, tables: list[list[int]]) -> list[torch.Tensor]:
        """Views of the request's per-request rows: its whole ring in every layer (the window
        and the block behind it that a boundary save reads), then each compressor's state."""
        g = self.groups
        views = [ring[tables[g.swa][0]] for ring in self.swa]
        if g.state is not None:
            state_block = tables[g.state][0]
            for st in [*self.layers.values(), *self.indexers.values()]:
                views += [st.buf_kv[state_block], st.buf_gate[state_block]]
                if st.ovl_kv is not None:
                    views += [st.ovl_kv[state_block], st.ovl_gate[state_block]]
        return views

    def snapshot(self, tables: list[list[int]], position: int) -> RequestState:
        """The ring and compressor state, copied on the device. Paged rows written after it (a
        window a draft token closed) lie past `position`'s entry counts: not read until the
        same window closes again and rewrites them."""
        return RequestState(position, [t.clone() for t in self._request_state(tables)])

    def restore_state(self, state: RequestState, tables: list[list[int]]) -> None:
        for dst, src in zip(self._request_state(tables), state.tensors, strict=True):
            dst.copy_(src)

    def export_kv(self, tables: list[list[int]], start: int, end: int) -> KVExport:
        B = self.cfg.block_tokens
        blocks = export_blocks(self, self.paged_groups, tables, start, end, B)
        state = [t.to("cpu", copy=True) for t in self._request_state(tables)]
        return KVExport(start, end, blocks, RequestState(end, state))

    def import_kv(self, export: KVExport, tables: list[list[int]]) -> None:
        B = self.cfg.block_tokens
        import_blocks(self, export.blocks, tables, export.start, export.end, B)
        self.restore_state(export.state, tables)

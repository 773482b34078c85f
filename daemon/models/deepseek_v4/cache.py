"""DeepSeek-V4 KV state as KV specs of the engine's manager, and its device storage.

Per request (fixed size, one block each):
  swa    ring of the last W-1+B raw KV per layer (B = prefix block tokens), so the
         sliding state at the last block boundary is still there when a request ends
  state  compressor open-window buffers and the CSA overlap (Ca of the last window)
Paged, one block per B tokens (B = lcm of the compress rates, 128 for real configs):
  csa    B/4 compressed entries + B/4 indexer keys per CSA layer, and the overlap
         state at the block's end (what a resume from this boundary needs)
  hca    B/128 compressed entries per HCA layer
Every tensor has one scratch row past the pool's (a ring, a state block, a paged block): the
idle rows of a CUDA-graph decode batch, and windows that close nothing there, write to it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from daemon.kv.spec import (
    CompressedKVSpec,
    CompressorStateSpec,
    KVGroup,
    SlidingWindowSpec,
)
from daemon.models.deepseek_v4.config import CSA, HCA, V4Config
from daemon.models.deepseek_v4.sparse import WINDOW_TILE

SWA, STATE = "swa", "state"


def ring_size(cfg: V4Config) -> int:
    return cfg.sliding_window - 1 + cfg.block_tokens


def kv_groups(cfg: V4Config, dtype: torch.dtype) -> list[KVGroup]:
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


@dataclass
class EntryTable:
    """The compressed entries of one kind that R requests see, by paged block: entry e of
    request r is entry e % per_block of block blocks[r, e // per_block]. Host metadata and
    gathers go by block (1 / block_tokens of the context), not by entry."""

    blocks: torch.Tensor  # [R, ceil(width / per_block)] each request's blocks, padded with 0
    per_block: int
    width: int  # the most entries any of the R requests sees

    @classmethod
    def build(
        cls, tables: list[list[int]], counts: list[int], width: int, per_block: int
    ) -> EntryTable:
        """Requests with entry tables `tables` that see their first `counts[i]` entries."""
        nblocks = -(-width // per_block)
        used = [t[: -(-c // per_block)] for t, c in zip(tables, counts)]
        blocks = torch.tensor([t + [0] * (nblocks - len(t)) for t in used], dtype=torch.long)
        return cls(blocks.view(len(tables), nblocks), per_block, width)

    def of(self, requests: slice) -> EntryTable:
        """The table of some of the requests."""
        return replace(self, blocks=self.blocks[requests])

    def gather(self, storage: torch.Tensor, requests: slice = slice(None)) -> torch.Tensor:
        """The requests' entries [r, width, dim] from `storage` [paged blocks, per_block, dim]:
        one copy per block."""
        blocks = self.blocks[requests]
        whole = storage.index_select(0, blocks.flatten())
        return whole.view(blocks.shape[0], -1, storage.shape[-1])[:, : self.width]

    def rows(self, picks: torch.Tensor) -> torch.Tensor:
        """Entry indices picks [R, ...] -> their rows in storage.view(-1, dim)."""
        flat = picks.flatten(1)
        block = self.blocks.gather(1, flat.div(self.per_block, rounding_mode="floor"))
        return (block * self.per_block + flat % self.per_block).view(picks.shape)

    def to(self, device: torch.device) -> EntryTable:
        self.blocks = self.blocks.to(device, non_blocking=True)
        return self


@dataclass(frozen=True)
class DecodeShape:
    """The fixed shapes of a graph's decode batch: `batch` rows (the step's decodes, then idle
    rows) and windows over `positions` (a multiple of the block tokens ≥ every position + 1)."""

    batch: int
    positions: int


def _move_tensor_fields(obj: object, device: torch.device) -> None:
    """Every tensor attribute of `obj` (and of its entry table) moved to `device`
    (asynchronously where it can)."""
    for name, value in vars(obj).items():
        if isinstance(value, torch.Tensor):
            setattr(obj, name, value.to(device, non_blocking=True))
        elif isinstance(value, EntryTable):
            value.to(device)


def _copy_tensor_fields(dst: object, src: object) -> None:
    """Every tensor attribute of `src` (and of its entry table) copied into `dst`'s tensor of
    the same name."""
    for name, value in vars(src).items():
        if isinstance(value, torch.Tensor):
            getattr(dst, name).copy_(value, non_blocking=True)
        elif isinstance(value, EntryTable):
            getattr(dst, name).blocks.copy_(value.blocks, non_blocking=True)


@dataclass
class V4SeqMeta:
    q_start: int
    start: int
    num_tokens: int
    swa_block: int
    state_block: int
    csa_table: list[int]
    hca_table: list[int]
    replay: bool = False  # bounded replay: compressors untouched, window from window_floor
    window_floor: int = 0
    fresh: bool = False  # first step of a request: reset its per-request state

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and not self.replay


@dataclass
class DecodeEntries:
    """The batched decodes' compressed entries of one kind (csa or hca), as index tensors
    built once per step on the host and shared by every layer of that kind."""

    table: EntryTable  # each request's entries, by block
    counts: torch.Tensor  # [B] entries each request sees, (position + 1) // rate
    buffer_rows: torch.Tensor  # [B] the token's row in `buf_kv.view(-1, C)`: its open window's slot
    closing: torch.Tensor  # [C] decodes whose token closes a window
    closing_state: torch.Tensor  # [C] their state blocks
    closed_rows: torch.Tensor  # [C] entry row of each closed window
    closed_positions: torch.Tensor  # [C] first position of each closed window (its RoPE)
    block_ends: torch.Tensor  # [C'] indices into `closing`: windows that end a paged block
    end_blocks: torch.Tensor  # [C'] the paged block each of those ends
    # fixed shapes (a graph's): `closing` is every row, True where a window really closes
    closing_mask: torch.Tensor | None = None
    # RoPE cos/sin at closed_positions: made by the first layer that needs it, then shared
    closed_rope: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(
        cls,
        tables: list[list[int]],
        positions: list[int],
        state_blocks: torch.Tensor,
        rate: int,
        per_block: int,
    ) -> DecodeEntries:
        counts = [(p + 1) // rate for p in positions]
        longest = max(counts)
        closing = [i for i, p in enumerate(positions) if (p + 1) % rate == 0]
        windows = [counts[i] - 1 for i in closing]
        ends = [j for j, w in enumerate(windows) if (w + 1) % per_block == 0]
        counts_t = torch.tensor(counts, dtype=torch.long)
        closing_t = torch.tensor(closing, dtype=torch.long)
        return cls(
            table=EntryTable.build(tables, counts, longest, per_block),
            counts=counts_t,
            buffer_rows=state_blocks * rate + torch.tensor([p % rate for p in positions]),
            closing=closing_t,
            closing_state=state_blocks[closing_t],
            closed_rows=torch.tensor(
                [
                    tables[i][w // per_block] * per_block + w % per_block
                    for i, w in zip(closing, windows)
                ],
                dtype=torch.long,
            ),
            closed_positions=torch.tensor([w * rate for w in windows], dtype=torch.long),
            block_ends=torch.tensor(ends, dtype=torch.long),
            end_blocks=torch.tensor(
                [tables[closing[j]][windows[j] // per_block] for j in ends], dtype=torch.long
            ),
        )

    @classmethod
    def build_padded(
        cls,
        tables: list[list[int]],
        positions: list[int],
        state_blocks: torch.Tensor,
        rate: int,
        per_block: int,
        shape: DecodeShape,
        scratch_block: int,
    ) -> DecodeEntries:
        """As `build`, in the fixed shapes of `shape`: rows for `shape.batch` requests (idle
        ones see no entry) and `shape.positions // rate` entries; every row goes through the
        window closing, those that close nothing (and idle rows) write to `scratch_block`.
        `state_blocks` is already padded."""
        idle = shape.batch - len(positions)
        counts = [(p + 1) // rate for p in positions] + [0] * idle
        longest = shape.positions // rate
        windows = [c - 1 for c in counts]
        closes = [(p + 1) % rate == 0 for p in positions] + [False] * idle
        ends = [c and (w + 1) % per_block == 0 for c, w in zip(closes, windows)]
        all_tables = tables + [[]] * idle
        scratch_row = scratch_block * per_block
        counts_t = torch.tensor(counts, dtype=torch.long)
        slots = torch.tensor([p % rate for p in positions] + [0] * idle)
        every = torch.arange(shape.batch)
        return cls(
            table=EntryTable.build(all_tables, counts, longest, per_block),
            counts=counts_t,
            buffer_rows=state_blocks * rate + slots,
            closing=every,
            closing_state=state_blocks,
            closed_rows=torch.tensor(
                [
                    t[w // per_block] * per_block + w % per_block if c else scratch_row
                    for t, w, c in zip(all_tables, windows, closes)
                ],
                dtype=torch.long,
            ),
            closed_positions=torch.tensor(
                [w * rate if c else 0 for w, c in zip(windows, closes)], dtype=torch.long
            ),
            block_ends=every,
            end_blocks=torch.tensor(
                [
                    t[w // per_block] if e else scratch_block
                    for t, w, e in zip(all_tables, windows, ends)
                ],
                dtype=torch.long,
            ),
            closing_mask=torch.tensor(closes),
        )

    def to(self, device: torch.device) -> DecodeEntries:
        _move_tensor_fields(self, device)
        return self

    def buffers(self) -> DecodeEntries:
        """A copy with tensors of its own (a graph's static inputs), no RoPE table cached."""
        copies = {k: v.clone() for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        table = replace(self.table, blocks=self.table.blocks.clone())
        return replace(self, **copies, table=table, closed_rope=None)


@dataclass
class ChunkWindows:
    """The prefill chunks' tokens through one kind's compressors (csa or hca), for all chunks
    at once, as index tensors built once per step on the host and shared by every layer of
    that kind. The rows fed are `src = cat(buffer[buffered], projected[token_rows])`: each
    chunk's open-window tokens from before the step, then its own tokens."""

    buffered: torch.Tensor  # [Nb] rows of `buf_kv.view(-1, C)` that open windows hold
    token_rows: torch.Tensor  # [Nt] rows of the flat token batch (every chunk but replays)
    windows: torch.Tensor  # [W, m] src rows of each window the chunks close
    left_src: torch.Tensor  # [L] src rows of the tokens left in open windows
    left_dst: torch.Tensor  # [L] their rows of `buf_kv.view(-1, C)`
    first_state: torch.Tensor  # [R] state blocks of the chunks that close a window
    previous: torch.Tensor  # [W] row of cat(overlap[first_state], each window's Ca): its Ca
    last: torch.Tensor  # [R] each such chunk's last window (its Ca is the next overlap)
    positions: torch.Tensor  # [W] first position of each window (its entry's RoPE)
    entry_rows: torch.Tensor  # [W] row of each entry in `entries.view(-1, dim)`
    block_ends: torch.Tensor  # [E] windows that end a paged block
    end_blocks: torch.Tensor  # [E] the paged block each of those ends

    @property
    def count(self) -> int:
        return self.windows.shape[0]

    @classmethod
    def build(
        cls, seqs: list[V4SeqMeta], tables: list[list[int]], rate: int, per_block: int
    ) -> ChunkWindows:
        """The chunks' windows, in order (their entry tables `tables`, `rate` tokens per
        window, `per_block` entries per paged block)."""
        buffered: list[int] = []
        token_rows: list[int] = []
        for s in seqs:
            buffered += range(s.state_block * rate, s.state_block * rate + s.start % rate)
            token_rows += range(s.q_start, s.q_start + s.num_tokens)
        windows: list[list[int]] = []
        left_src: list[int] = []
        left_dst: list[int] = []
        first_state: list[int] = []
        previous: list[int] = []  # < 0: -1 - the chunk's index in first_state
        last: list[int] = []
        positions: list[int] = []
        entry_rows: list[int] = []
        block_ends: list[int] = []
        end_blocks: list[int] = []
        buf_at, tok_at = 0, len(buffered)
        for s, table in zip(seqs, tables):
            held = s.start % rate
            rows = list(range(buf_at, buf_at + held)) + list(range(tok_at, tok_at + s.num_tokens))
            buf_at, tok_at = buf_at + held, tok_at + s.num_tokens
            closed = len(rows) // rate
            left_src += rows[closed * rate :]
            left_dst += range(s.state_block * rate, s.state_block * rate + len(rows) % rate)
            if not closed:
                continue
            first_window = (s.start - held) // rate
            previous.append(-1 - len(first_state))
            previous += range(len(windows), len(windows) + closed - 1)
            first_state.append(s.state_block)
            for w in range(first_window, first_window + closed):
                if (w + 1) % per_block == 0:
                    block_ends.append(len(windows))
                    end_blocks.append(table[w // per_block])
                windows.append(rows[(w - first_window) * rate : (w - first_window + 1) * rate])
                positions.append(w * rate)
                entry_rows.append(table[w // per_block] * per_block + w % per_block)
            last.append(len(windows) - 1)
        r = len(first_state)

        def long(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long)

        return cls(
            buffered=long(buffered),
            token_rows=long(token_rows),
            windows=long(windows).view(-1, rate),
            left_src=long(left_src),
            left_dst=long(left_dst),
            first_state=long(first_state),
            previous=long([-1 - p if p < 0 else r + p for p in previous]),
            last=long(last),
            positions=long(positions),
            entry_rows=long(entry_rows),
            block_ends=long(block_ends),
            end_blocks=long(end_blocks),
        )

    def to(self, device: torch.device) -> ChunkWindows:
        _move_tensor_fields(self, device)
        return self


@dataclass
class ChunkQueries:
    """Every prefill chunk and replay of the step, attended at once: each padded to `padded`
    queries (whole tiles of WINDOW_TILE; padded rows repeat its last query and are dropped),
    as index tensors built once per step on the host and shared by every layer."""

    padded: int
    query_rows: torch.Tensor  # [R, padded] row of each query in the flat token batch
    positions: torch.Tensor  # [R, padded] its position
    out_src: torch.Tensor  # [Q] the real queries' rows in the flat [R * padded] layout
    out_rows: torch.Tensor  # [Q] their rows in the flat token batch
    ring_rows: torch.Tensor  # [R, W - 1] ring rows of the W - 1 positions before each chunk
    missing: torch.Tensor  # [R] how many of those have no KV (before 0 or the replay floor)
    ring_dst: torch.Tensor  # [K] ring rows the chunks' last tokens go to
    ring_src: torch.Tensor  # [K] their rows in the flat token batch
    # by kind: the entries each chunk sees at its end; a query sees (position + 1) // rate
    entry_tables: dict[str, EntryTable] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return self.query_rows.shape[0]

    @classmethod
    def build(
        cls, seqs: list[V4SeqMeta], cfg: V4Config, ring: int, per_block: dict[str, int]
    ) -> ChunkQueries:
        w = cfg.sliding_window
        longest = max(s.num_tokens for s in seqs)
        padded = -(-longest // WINDOW_TILE) * WINDOW_TILE
        query_rows, positions, ring_rows, missing = [], [], [], []
        out_src: list[int] = []
        out_rows: list[int] = []
        ring_dst: list[int] = []
        ring_src: list[int] = []
        for r, s in enumerate(seqs):
            n, base = s.num_tokens, s.swa_block * ring
            query_rows.append([s.q_start + min(i, n - 1) for i in range(padded)])
            positions.append([s.start + min(i, n - 1) for i in range(padded)])
            out_src += range(r * padded, r * padded + n)
            out_rows += range(s.q_start, s.q_start + n)
            ring_rows.append([base + max(p, 0) % ring for p in range(s.start - (w - 1), s.start)])
            missing.append(w - 1 - min(s.start - s.window_floor, w - 1))
            keep = min(n, ring)
            ring_dst += [base + p % ring for p in range(s.start + n - keep, s.start + n)]
            ring_src += range(s.q_start + n - keep, s.q_start + n)
        out = cls(
            padded=padded,
            query_rows=torch.tensor(query_rows, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            out_src=torch.tensor(out_src, dtype=torch.long),
            out_rows=torch.tensor(out_rows, dtype=torch.long),
            ring_rows=torch.tensor(ring_rows, dtype=torch.long).view(len(seqs), w - 1),
            missing=torch.tensor(missing, dtype=torch.long),
            ring_dst=torch.tensor(ring_dst, dtype=torch.long),
            ring_src=torch.tensor(ring_src, dtype=torch.long),
        )
        for kind, rate in cfg.compress_rates.items():
            if kind in per_block:
                tables = [s.csa_table if kind == CSA else s.hca_table for s in seqs]
                counts = [(s.start + s.num_tokens) // rate for s in seqs]
                if max(counts):
                    out.entry_tables[kind] = EntryTable.build(
                        tables, counts, max(counts), per_block[kind]
                    )
        return out

    def to(self, device: torch.device) -> ChunkQueries:
        _move_tensor_fields(self, device)
        for table in self.entry_tables.values():
            table.to(device)
        return self


@dataclass
class V4Decodes:
    """Every one-token step of the batch, as index tensors shared by all layers."""

    rows: torch.Tensor | slice  # their rows in the flat token batch
    new_rows: torch.Tensor  # [B] ring row (in `ring.view(-1, dim)`) each new token goes to
    window_rows: torch.Tensor  # [B, W] ring rows of each window, the new token last
    window_padding: torch.Tensor | None  # [B, W] True before position 0; None when none is
    state_blocks: torch.Tensor  # [B]
    entries: dict[str, DecodeEntries] = field(default_factory=dict)  # by kind

    def to(self, device: torch.device) -> V4Decodes:
        _move_tensor_fields(self, device)
        for value in self.entries.values():
            value.to(device)
        return self

    def buffers(self) -> V4Decodes:
        """A copy with tensors of its own: a graph's static inputs, shaped like these."""
        copies = {k: v.clone() for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        entries = {kind: e.buffers() for kind, e in self.entries.items()}
        return replace(self, **copies, entries=entries)

    def fill(self, other: V4Decodes) -> None:
        """Copy another step's metadata, of the same shapes, into these tensors."""
        _copy_tensor_fields(self, other)
        for kind, e in self.entries.items():
            _copy_tensor_fields(e, other.entries[kind])

    def fresh(self) -> V4Decodes:
        """The same tensors with no per-step table cached (one forward's view)."""
        entries = {kind: replace(e, closed_rope=None) for kind, e in self.entries.items()}
        return replace(self, entries=entries)


@dataclass
class V4Batch:
    seqs: list[V4SeqMeta] = field(default_factory=list)
    decodes: V4Decodes | None = None
    # RoPE cos/sin of the step's positions by id of the rope: made by the first layer
    # that needs them, then shared by every other
    rope_tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    shape: DecodeShape | None = None  # decodes padded to a graph's shapes
    # by kind: every chunk's tokens (but replays') through that kind's compressors
    compression: dict[str, ChunkWindows] = field(default_factory=dict)
    queries: ChunkQueries | None = None  # every chunk's queries
    # [T] 1 for the rows the MoE load statistics count, 0 for a graph's idle rows; None: all
    counted: torch.Tensor | None = None
    fresh_states: torch.Tensor | None = None  # state blocks of requests starting this step

    @property
    def chunks(self) -> list[V4SeqMeta]:
        """The sequences that are not batched decodes: prefill chunks and replays."""
        return [s for s in self.seqs if not s.is_decode]

    def to(self, device: torch.device) -> V4Batch:
        if device.type == "cpu":
            return self
        if self.fresh_states is not None:
            self.fresh_states = self.fresh_states.to(device, non_blocking=True)
        if self.queries is not None:
            self.queries.to(device)
        for windows in self.compression.values():
            windows.to(device)
        if self.decodes is not None:
            self.decodes.to(device)
        return self


class V4Cache:
    def __init__(
        self, cfg: V4Config, groups: list[KVGroup], num_blocks: list[int], device: torch.device
    ) -> None:
        by_name = {g.spec.name: (g, n) for g, n in zip(groups, num_blocks)}
        dtype = by_name[SWA][0].spec.dtype
        self.cfg = cfg
        self.group_index = {g.spec.name: i for i, g in enumerate(groups)}
        self.ring = ring_size(cfg)
        # compressed entries per paged block, by kind
        self.per_block = {k: cfg.block_tokens // r for k, r in cfg.compress_rates.items()}
        # the scratch rows: one past each pool
        self.scratch_swa = by_name[SWA][1]
        self.scratch_state = by_name[STATE][1] if STATE in by_name else 0
        self.scratch_block = {kind: by_name[kind][1] for kind in (CSA, HCA) if kind in by_name}
        # set by the decode graphs: (decodes, context) -> the shape a decode-only step of that
        # many requests, all positions below context, is padded to; None where none fits
        self.decode_shape: Callable[[int, int], DecodeShape | None] | None = None
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
            n_csa = by_name[CSA][1]
            self.layers[layer] = state(cfg.csa_rate, 2 * hd, hd, n_csa, True)
            self.indexers[layer] = state(cfg.csa_rate, 2 * ihd, ihd, n_csa, True)
        for layer in cfg.layers_of(HCA):
            self.layers[layer] = state(cfg.hca_rate, hd, hd, by_name[HCA][1], False)

    def block_views(self, group: int) -> list[torch.Tensor]:
        """The tensors of paged group `group` (csa or hca), indexed by block on dim 0; the
        scratch block is left out."""
        name = next(n for n, i in self.group_index.items() if i == group)
        pool = self.scratch_block[name]
        views: list[torch.Tensor] = []
        for layer in self.cfg.layers_of(CSA if name == CSA else HCA):
            for st in (self.layers[layer], self.indexers.get(layer)):
                if st is None:
                    continue
                views.append(st.entries[:pool])
                if st.block_ovl_kv is not None:
                    views += [st.block_ovl_kv[:pool], st.block_ovl_gate[:pool]]
        return views

    def build_attention(self, seqs) -> V4Batch:
        gi = self.group_index
        batch = V4Batch()
        for s in seqs:
            tables = s.block_tables
            meta = V4SeqMeta(
                q_start=s.q_start,
                start=s.start,
                num_tokens=s.num_tokens,
                swa_block=tables[gi[SWA]][0],
                state_block=tables[gi[STATE]][0] if STATE in gi else -1,
                csa_table=tables[gi[CSA]] if CSA in gi else [],
                hca_table=tables[gi[HCA]] if HCA in gi else [],
                replay=s.replay,
                window_floor=s.window_floor,
                fresh=s.start == 0 and not s.replay,
            )
            batch.seqs.append(meta)
        fresh = [s.state_block for s in batch.seqs if s.fresh]
        if fresh and STATE in gi:
            batch.fresh_states = torch.tensor(fresh, dtype=torch.long)
        chunks = batch.chunks
        if chunks:
            kinds = {k: n for k, n in self.per_block.items() if k in gi}
            batch.queries = ChunkQueries.build(chunks, self.cfg, self.ring, kinds)
        fed = [s for s in chunks if not s.replay]
        if fed:
            for kind in (CSA, HCA):
                if kind in gi:
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
        for kind in (CSA, HCA):
            if kind in self.group_index:
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
        swa_block = tables[self.group_index[SWA]][0]
        if op.snapshot is not None:
            idx = self._window_before(op.position)
            snap = op.snapshot.tensor.to(self.swa[0].device)
            for layer, ring in enumerate(self.swa):
                ring[swa_block, idx] = snap[layer]
        if STATE not in self.group_index or CSA not in self.group_index:
            return
        state_block = tables[self.group_index[STATE]][0]
        boundary_block = tables[self.group_index[CSA]][op.position // self.cfg.block_tokens - 1]
        for layer in self.cfg.layers_of(CSA):
            for st in (self.layers[layer], self.indexers[layer]):
                st.ovl_kv[state_block] = st.block_ovl_kv[boundary_block]
                st.ovl_gate[state_block] = st.block_ovl_gate[boundary_block]

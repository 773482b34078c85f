"""DeepSeek-V4 per-step attention metadata: index tensors built once per step on the host
(decodes, prefill chunks' windows and queries, entry tables) and shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from daemon.models.deepseek_v4.config import CSA, V4Config
from daemon.models.deepseek_v4.sparse import WINDOW_TILE


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

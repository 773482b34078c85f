"""The KV handoff seam of prefill/decode disaggregation: where a decode engine gets a prompt's KV
state from (KVSource), what comes (Fetched: full blocks may stay in the shared block store),
how it fails (HandoffFailed), and the checks an export must pass here."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from daemon.kv.manager import KVManager
from daemon.models.base import KVExport, ModelCache


class HandoffFailed(Exception):
    """Any reason an export cannot be used: the engine computes the prompt itself instead."""


class LayoutMismatch(HandoffFailed):
    """The export is not of this cache's layout (groups, blocks, shapes, dtypes, position)."""


@dataclass(frozen=True)
class StoreOffer:
    """A node's block store as a handoff names it: its id (the same store, wherever mounted),
    the model fingerprint its blocks are written under, and the prefix block size."""

    identity: str
    fingerprint: str  # hex
    block_size: int


@dataclass(frozen=True)
class Fetched:
    """What a handoff brings: the KV state of [export.start, end), and the hash-chain keys of
    the full blocks before `export.start`, published in the shared block store (none: the
    whole range came in `export`)."""

    export: KVExport
    stored: list[bytes] = field(default_factory=list)


class KVSource(Protocol):
    """Where a decode engine fetches a prompt's KV state from (a prefill node, over the wire)."""

    async def fetch(
        self,
        prompt_ids: list[int],
        block_keys: list[bytes],
        end: int,
        store: StoreOffer | None = None,
    ) -> Fetched:
        """The KV state of positions [0, end) of `prompt_ids` (`end` = len(prompt_ids) - 1;
        `block_keys`: the hash-chain keys of the prompt's full blocks, for routing). With
        `store` (this node's block store) the source may leave leading full blocks of [0, end)
        in that store, named by their keys (`block_keys[:n]`). Raises HandoffFailed,
        TimeoutError or OSError; never hangs (its own timeouts inside)."""
        ...


# why a decode engine computed a prompt itself (a request given a KVSource)
RECOMPUTE_REASONS = (
    "failed",
    "timeout",
    "connection",
    "layout",
    "no_room",
    "error",
    "short_prompt",
    "prompt_logprobs",
)

# decode side: fetch (route, the prefill node's compute, the payload), store (the full blocks
# read from the block store), import; prefill side: export (compute, device read), publish
# (waiting for the full blocks' store writes), send
HANDOFF_PHASES = ("fetch", "store", "import", "export", "publish", "send")


@dataclass
class HandoffStats:
    """Handoff counts since start: requests imported or recomputed (by reason) on the decode
    side, exports made on the prefill side, the bytes each way over the wire, the full blocks
    that went through the block store instead (and the handoffs whose stored blocks did not all
    read back, fetched again over the wire), and the seconds spent by phase (HANDOFF_PHASES,
    of the handoffs that succeeded)."""

    imported: int = 0
    exported: int = 0
    recomputed: Counter[str] = field(default_factory=Counter)
    bytes_imported: int = 0
    bytes_exported: int = 0
    blocks_stored: int = 0  # prefill side: full blocks left in the store, not sent
    blocks_from_store: int = 0  # decode side: full blocks read from the store
    bytes_from_store: int = 0
    store_fallbacks: int = 0  # decode side: a stored block missing, bad or late: fetched again
    seconds: Counter[str] = field(default_factory=Counter)  # by HANDOFF_PHASES

    def as_dict(self) -> dict[str, object]:
        return {
            "kv_handoff_imported": self.imported,
            "kv_handoff_recomputed": sum(self.recomputed.values()),
            "kv_handoff_exported": self.exported,
            "kv_handoff_bytes_imported": self.bytes_imported,
            "kv_handoff_bytes_exported": self.bytes_exported,
            "kv_handoff_blocks_stored": self.blocks_stored,
            "kv_handoff_blocks_from_store": self.blocks_from_store,
            "kv_handoff_bytes_from_store": self.bytes_from_store,
            "kv_handoff_store_fallbacks": self.store_fallbacks,
            "kv_handoff_recomputed_by_reason": {r: self.recomputed[r] for r in RECOMPUTE_REASONS},
            "kv_handoff_seconds_by_phase": {p: self.seconds[p] for p in HANDOFF_PHASES},
        }


def export_bytes(export: KVExport) -> int:
    tensors = [t for rows in export.blocks.values() for t in rows] + export.state.tensors
    return sum(t.numel() * t.element_size() for t in tensors)


def after_blocks(export: KVExport, n: int, block_size: int) -> KVExport:
    """The export less its first `n` blocks (views of its tensors: nothing is copied)."""
    if not n:
        return export
    rows = {g: [t[n:] for t in views] for g, views in export.blocks.items()}
    return replace(export, start=export.start + n * block_size, blocks=rows)


def check_blocks(
    export: KVExport, cache: ModelCache, kv: KVManager, end: int, start: int = 0
) -> None:
    """Raise LayoutMismatch unless `export` holds positions [start, end) in this cache's paged
    layout: the same groups, for each the same block views with `ceil(end / block size) -
    start / block size` rows of this cache's shapes and dtypes."""
    if (export.start, export.end, export.state.position) != (start, end, end):
        raise LayoutMismatch(
            f"the export holds [{export.start}, {export.end}) at {export.state.position}, "
            f"not [{start}, {end})"
        )
    if sorted(export.blocks) != sorted(kv.paged):
        raise LayoutMismatch(f"the export has groups {sorted(export.blocks)}, not {kv.paged}")
    for group in kv.paged:
        views, rows = cache.block_views(group), export.blocks[group]
        size = kv.groups[group].spec.block_size
        if start % size:
            raise LayoutMismatch(f"group {group}: {start} is not on a block boundary")
        n = math.ceil(end / size) - start // size
        if len(rows) != len(views):
            raise LayoutMismatch(f"group {group}: {len(rows)} block views, not {len(views)}")
        for view, part in zip(views, rows):
            want = (n, *view.shape[1:])
            if not isinstance(part, torch.Tensor) or tuple(part.shape) != want:
                raise LayoutMismatch(f"group {group}: a block view is not of shape {want}")
            if part.dtype != view.dtype:
                raise LayoutMismatch(f"group {group}: {part.dtype}, not {view.dtype}")


def check_state(export: KVExport, cache: ModelCache, tables: list[list[int]]) -> None:
    """Raise LayoutMismatch unless the export's per-request state has this cache's tensors (as a
    snapshot of the request's rows has them). On the device thread."""
    want = cache.snapshot(tables, export.end).tensors
    got = export.state.tensors
    if len(got) != len(want) or any(
        not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype
        for g, w in zip(got, want)
    ):
        raise LayoutMismatch("the export's per-request state does not fit this cache")

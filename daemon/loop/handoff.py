"""The KV handoff seam of prefill/decode disaggregation: where a decode engine gets a prompt's KV
state from (KVSource), how it fails (HandoffFailed), and the checks an export must pass here."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

import torch

from daemon.kv.manager import KVManager
from daemon.models.base import KVExport, ModelCache


class HandoffFailed(Exception):
    """Any reason an export cannot be used: the engine computes the prompt itself instead."""


class LayoutMismatch(HandoffFailed):
    """The export is not of this cache's layout (groups, blocks, shapes, dtypes, position)."""


class KVSource(Protocol):
    """Where a decode engine fetches a prompt's KV state from (a prefill node, over the wire)."""

    async def fetch(self, prompt_ids: list[int], block_keys: list[bytes], end: int) -> KVExport:
        """The KV state of positions [0, end) of `prompt_ids` (`end` = len(prompt_ids) - 1;
        `block_keys`: the hash-chain keys of the prompt's full blocks, for routing). Raises
        HandoffFailed, TimeoutError or OSError; never hangs (its own timeouts inside)."""
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

HANDOFF_PHASES = ("fetch", "import", "export", "send")


@dataclass
class HandoffStats:
    """Handoff counts since start: requests imported or recomputed (by reason) on the decode
    side, exports made on the prefill side, the bytes each way, and the seconds spent by phase
    (of the handoffs that succeeded): the decode side's fetch (route, the prefill node's compute
    and the payload) and import, the prefill side's export (compute and device read) and send."""

    imported: int = 0
    exported: int = 0
    recomputed: Counter[str] = field(default_factory=Counter)
    bytes_imported: int = 0
    bytes_exported: int = 0
    seconds: Counter[str] = field(default_factory=Counter)  # by HANDOFF_PHASES

    def as_dict(self) -> dict[str, object]:
        return {
            "kv_handoff_imported": self.imported,
            "kv_handoff_recomputed": sum(self.recomputed.values()),
            "kv_handoff_exported": self.exported,
            "kv_handoff_bytes_imported": self.bytes_imported,
            "kv_handoff_bytes_exported": self.bytes_exported,
            "kv_handoff_recomputed_by_reason": {r: self.recomputed[r] for r in RECOMPUTE_REASONS},
            "kv_handoff_seconds_by_phase": {p: self.seconds[p] for p in HANDOFF_PHASES},
        }


def export_bytes(export: KVExport) -> int:
    tensors = [t for rows in export.blocks.values() for t in rows] + export.state.tensors
    return sum(t.numel() * t.element_size() for t in tensors)


def check_blocks(export: KVExport, cache: ModelCache, kv: KVManager, end: int) -> None:
    """Raise LayoutMismatch unless `export` holds positions [0, end) in this cache's paged layout:
    the same groups, for each the same block views with `ceil(end / block size)` rows of this
    cache's shapes and dtypes."""
    if (export.start, export.end, export.state.position) != (0, end, end):
        raise LayoutMismatch(
            f"the export holds [{export.start}, {export.end}) at {export.state.position}, "
            f"not [0, {end})"
        )
    if sorted(export.blocks) != sorted(kv.paged):
        raise LayoutMismatch(f"the export has groups {sorted(export.blocks)}, not {kv.paged}")
    for group in kv.paged:
        views, rows = cache.block_views(group), export.blocks[group]
        n = math.ceil(end / kv.groups[group].spec.block_size)
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

"""A request as the prefix cache sees it: its prefix state and cache statistics (parts the
request keeps), and the Protocol of what else the cache reads from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from daemon.kv.prefix_hash import ContentSpan

if TYPE_CHECKING:
    import torch

    from daemon.kv.tier_ops import RestoreOp


@dataclass
class PrefixState:
    """Where one request stands with the prefix cache; written by the cache only, except the
    scheduler's reset when the request gives its blocks back (`forget_blocks`)."""

    cache_salt: bytes = b""  # separates tenants' prefixes
    traffic_class: str = "chat"  # block-store retention class
    # (start, end, digest): placeholder positions standing for content (images), in the keys
    content: list[ContentSpan] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)
    num_registered: int = 0  # leading blocks already findable in the prefix cache
    replay_from: int = 0  # a replay recomputes [replay_from, replay_until) with its
    replay_until: int = 0  # sliding window limited to that range
    pending_restore: RestoreOp | None = None  # for the request's next first step
    swa_marks: list[int] = field(default_factory=list)  # boundaries to snapshot the SWA ring at
    loaded: dict[bytes, torch.Tensor] = field(
        default_factory=dict
    )  # store payloads until admission
    store_checked: int = 0  # leading usable blocks last known to be in memory or the store
    store_probes: int = 0  # store re-reads at admission (the prefix was evicted meanwhile)

    def forget_blocks(self) -> None:
        """The request holds no blocks any more: it recomputes from position 0."""
        self.replay_until = self.num_registered = 0


@dataclass
class CacheUse:
    """What the prefix cache gave one request: its usage report and the tiers' statistics."""

    num_cached_tokens: int = 0  # prompt positions not computed (found, less any replay)
    tokens_by_tier: dict[str, int] = field(default_factory=dict)  # prompt tokens
    lookups: dict[str, int] = field(default_factory=dict)  # blocks, by tier
    hits: dict[str, int] = field(default_factory=dict)


class PromptLogprobs(Protocol):
    @property
    def prompt_logprobs(self) -> int | None: ...


class PrefixRequest(Protocol):
    """What the prefix cache reads and writes of a request (loop.request.Request is one)."""

    prefix: PrefixState
    cache: CacheUse
    num_computed: int  # positions whose KV is computed or scheduled

    @property
    def request_id(self) -> str: ...
    @property
    def prompt_ids(self) -> list[int]: ...
    @property
    def output_ids(self) -> list[int]: ...
    @property
    def params(self) -> PromptLogprobs: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_known_tokens(self) -> int: ...

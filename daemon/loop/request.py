"""A generation request, its sampling parameters and the outputs it streams back."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from daemon.kv.request_state import CacheUse, PrefixState
from daemon.loop.request_stats import RequestStats

if TYPE_CHECKING:
    from daemon.loop.constraint import Constraint
    from daemon.loop.images import ImageSpan


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off, N = sampled token plus top-N alternatives
    # None = off, N = each prompt token's logprob given the tokens before it, plus top-N
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    include_stop_str_in_output: bool = False
    # constrained decoding: per request and stateful (loop.constraint.GrammarConstraint)
    constraint: Constraint | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 disables it)")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError("logprobs must be between 0 and 20")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError("prompt_logprobs must be between 0 and 20")
        if any(t < 0 or not -100 <= b <= 100 for t, b in self.logit_bias.items()):
            raise ValueError("logit_bias maps token ids >= 0 to biases in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class RequestStatus(enum.Enum):
    # out of the queues: its prefix blocks are being read from the block store, or its KV is
    # moving (a handoff's fetch and import, a prefill's export)
    LOADING = enum.auto()
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), best first
    rank: int | None = None  # the token's rank in the vocabulary (1 = most likely), if computed


@dataclass
class RequestOutput:
    """One increment of a request's output; `finished` marks the last one."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] | None = None
    # with the first output of a request that asked for them: one per prompt token, None first
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(eq=False)
class Request:
    """Engine-side state of one sequence: identity, tokens and status, and its parts: where it
    stands with the prefix cache (`prefix`), what the cache gave it (`cache`), when things
    happened to it (`stats`).

    Token bookkeeping with overlap: the scheduler may schedule step N+1 before
    step N's sampled token reaches the host, so it counts tokens it has asked
    for (`num_sampled_scheduled`) apart from those it has seen (`output_ids`).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival: float = field(default_factory=time.monotonic)
    eos_token_ids: tuple[int, ...] = ()

    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # by prompt position
    num_computed: int = 0  # positions whose KV is computed or scheduled
    num_sampled_scheduled: int = 0  # samples scheduled, seen or not
    num_inflight_steps: int = 0
    # a step verifying drafts is in flight: how many tokens it yields is known once processed
    verifying: bool = False
    # decodes since its drafts were last chosen for verification (speculative decoding)
    decodes_without_drafts: int = 0
    # decodes since the policy declined a draft of it (0: none declined since one was verified)
    declined_decodes: int = 0
    # the tokens (drafts aside) of the step whose plan last declined it: a lighter step asks again
    declined_load: int = 0
    # (known tokens, worth it) of the last check whether to hold it back a step for drafts
    hold_check: tuple[int, bool] | None = None
    slot: int = -1  # row in the runner's per-request device state while running
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    prefix: PrefixState = field(default_factory=PrefixState)
    cache: CacheUse = field(default_factory=CacheUse)
    stats: RequestStats = field(default_factory=RequestStats)
    images: list[ImageSpan] = field(default_factory=list)  # embeddings at their placeholders
    # positions from here on wait for the images' embeddings (None: nothing awaited); the text
    # before the first image prefills meanwhile
    images_until: int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def seq_len(self) -> int:
        """Length the sequence will have once every scheduled step has run."""
        return len(self.prompt_ids) + self.num_sampled_scheduled

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, position: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[position] if position < n else self.output_ids[position - n]

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, float]:
        """Lower is served first: priority (smaller first, as in vLLM), then arrival."""
        return (self.priority, self.arrival)

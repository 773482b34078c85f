"""When things happened to a request, and how often it was preempted: for the latency
metrics and the access log."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestStats:
    num_preemptions: int = 0
    scheduled_time: float | None = None  # first admitted to a step (monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None

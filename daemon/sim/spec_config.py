"""A simulated node's speculation settings (`deepinfer simulate`'s flags): torch-free, for the
command line's imports; sim/spec.py runs them."""

from __future__ import annotations

from dataclasses import dataclass

from daemon.loop.spec.policy import MIN_GAIN, POLICIES


@dataclass
class SpecConfig:
    policy: str = "adaptive"  # one of loop/spec/policy.POLICIES
    k: int = 4  # the most drafts a request verifies in a step
    acceptance: float = 0.7  # each draft token's chance to be accepted (given those before)
    spread: float = 0.0  # a request's rate: uniform in acceptance +- spread (clipped to [0, 1])
    seed: int = 0
    min_gain: float = MIN_GAIN  # adaptive: as `serve --spec-min-gain`

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"spec policy must be one of {', '.join(POLICIES)}")
        if self.k < 1:
            raise ValueError("speculation needs at least one draft token per step")
        if not 0 <= self.acceptance <= 1 or self.spread < 0:
            raise ValueError("acceptance must be in [0, 1], spread >= 0")
        if not self.min_gain >= 0:
            raise ValueError("min_gain must be >= 0")

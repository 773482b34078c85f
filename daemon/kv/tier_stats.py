"""Prefix-cache accounting by tier: block lookups, hits and bytes moved, and the token hit rate."""

from __future__ import annotations

from dataclasses import dataclass, field

TIERS = ("device", "host", "store")


@dataclass
class TierCounters:
    lookups: int = 0  # blocks looked for in this tier (those the tiers above missed)
    hits: int = 0
    bytes_read: int = 0  # host: copied to the device; store: read from files
    bytes_written: int = 0  # host: copied from the device; store: written to files


@dataclass
class CacheStats:
    tiers: dict[str, TierCounters] = field(
        default_factory=lambda: {t: TierCounters() for t in TIERS}
    )
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0  # prompt tokens whose block KV came from a tier

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {
            "prefix_requests": self.requests,
            "prefix_prompt_tokens": self.prompt_tokens,
            "prefix_hit_tokens": self.hit_tokens,
            "prefix_token_hit_rate": self.hit_tokens / self.prompt_tokens
            if self.prompt_tokens
            else 0.0,
        }
        for name, t in self.tiers.items():
            out |= {
                f"prefix_{name}_lookups": t.lookups,
                f"prefix_{name}_hits": t.hits,
                f"prefix_{name}_hit_rate": t.hits / t.lookups if t.lookups else 0.0,
                f"prefix_{name}_bytes_read": t.bytes_read,
                f"prefix_{name}_bytes_written": t.bytes_written,
            }
        return out

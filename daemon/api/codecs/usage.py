"""OpenAI's usage details: the prompt's cached tokens, and deepinfer's split of them by tier."""

from __future__ import annotations


def prompt_tokens_details(cached_tokens: int, by_tier: dict[str, int] | None) -> dict:
    details: dict = {"cached_tokens": cached_tokens}
    if by_tier:
        details["cached_tokens_by_tier"] = by_tier
    return details

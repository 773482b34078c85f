"""Token logprobs in the OpenAI wire formats (legacy completions: tokens/token_logprobs/...),
and vLLM's `prompt_logprobs`."""

from __future__ import annotations

from collections.abc import Sequence

from daemon.loop.request import TokenLogprob
from daemon.models.tokenizer import TextTokenizer


def token_text(tokenizer: TextTokenizer | None, token_id: int) -> str:
    return tokenizer.token_text(token_id) if tokenizer else f"token_id:{token_id}"


def completion_logprobs(
    entries: Sequence[TokenLogprob],
    tokenizer: TextTokenizer | None,
    offset: int = 0,
    *,
    unscored: Sequence[int] = (),
    top_n: int | None = None,
) -> tuple[dict, int]:
    """The legacy `logprobs` object for these tokens, and the text offset after them.

    `unscored` tokens come first with null logprobs (an echoed prompt's first token).
    `top_logprobs[i]` maps token text to logprob for the top-N alternatives (at most `top_n`),
    plus the token itself (as vLLM does), so logprobs=0 still shows the sampled token.
    """
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for token_id in unscored:
        text = token_text(tokenizer, token_id)
        tokens.append(text)
        token_logprobs.append(None)
        top_logprobs.append(None)
        text_offset.append(offset)
        offset += len(text)
    for entry in entries:
        text = token_text(tokenizer, entry.token_id)
        top = {token_text(tokenizer, t): lp for t, lp in entry.top[:top_n]}
        top.setdefault(text, entry.logprob)
        tokens.append(text)
        token_logprobs.append(entry.logprob)
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }, offset


def vllm_prompt_logprobs(
    scored: Sequence[TokenLogprob | None], tokenizer: TextTokenizer | None
) -> list[dict[str, dict] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, {token id: {logprob, rank, decoded_token}} for
    its top-N alternatives and the token itself; null for the first token."""
    out: list[dict[str, dict] | None] = []
    for entry in scored:
        if entry is None:
            out.append(None)
            continue
        alternatives = {
            str(t): {"logprob": lp, "rank": rank, "decoded_token": token_text(tokenizer, t)}
            for rank, (t, lp) in enumerate(entry.top, 1)
        }
        alternatives[str(entry.token_id)] = {
            "logprob": entry.logprob,
            "rank": entry.rank,
            "decoded_token": token_text(tokenizer, entry.token_id),
        }
        out.append(alternatives)
    return out

"""Token logprobs in the OpenAI wire formats (legacy completions: tokens/token_logprobs/...)."""

from __future__ import annotations

from daemon.loop.request import TokenLogprob
from daemon.tokenizer import TextTokenizer


def token_text(tokenizer: TextTokenizer | None, token_id: int) -> str:
    return tokenizer.token_text(token_id) if tokenizer else f"token_id:{token_id}"


def completion_logprobs(
    entries: list[TokenLogprob], tokenizer: TextTokenizer | None, offset: int = 0
) -> tuple[dict, int]:
    """The legacy `logprobs` object for these tokens, and the text offset after them.

    `top_logprobs[i]` maps token text to logprob for the top-N alternatives, plus the
    sampled token itself (as vLLM does), so logprobs=0 still shows the sampled token.
    """
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []
    for entry in entries:
        text = token_text(tokenizer, entry.token_id)
        top = {token_text(tokenizer, t): lp for t, lp in entry.top}
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

"""Parse and validate a /v1/completions body (OpenAI legacy completions plus vLLM extras), and
tokenize its prompts."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from daemon.api.codecs.base import CodecError, JsonObject
from daemon.api.codecs.jobs import seeded
from daemon.api.codecs.params import (
    get_bool,
    get_int,
    get_object,
    get_str,
    is_int,
    sampling_params,
)
from daemon.loop.request import SamplingParams
from daemon.models.tokenizer import TextTokenizer

MAX_N = 16
MAX_LOGPROBS = 20
_TOKENIZE_IN_THREAD_CHARS = 16_384  # longer text is tokenized off the event loop


@dataclass
class CompletionRequest:
    model: str
    prompts: list[str | list[int]]  # text or token ids, one entry per prompt
    params: SamplingParams
    n: int
    echo: bool  # the answer starts with the prompt (and its logprobs, if asked)
    echo_only: bool  # echo with max_tokens 0: the prompt alone (one token is computed, not sent)
    stream: bool
    include_usage: bool
    return_token_ids: bool
    priority: int

    def params_for(self, choice: int) -> SamplingParams:
        return seeded(self.params, choice)


def parse_completion_request(body: JsonObject) -> CompletionRequest:
    model = body.get("model")
    if model is None:
        raise CodecError("'model' is required", "model")
    if not isinstance(model, str):
        raise CodecError("'model' must be a string", "model")
    prompts = _parse_prompt(body.get("prompt"))
    echo = get_bool(body, "echo")
    if get_str(body, "suffix"):
        raise CodecError("'suffix' is not supported", "suffix")
    get_str(body, "user")  # accepted and ignored, but it must be a string
    n = get_int(body, "n", 1, lo=1, hi=MAX_N)
    best_of = get_int(body, "best_of", lo=1)
    if best_of is not None and best_of != n:
        raise CodecError("'best_of' is only supported when it equals 'n'", "best_of")
    max_tokens = get_int(body, "max_tokens", 16, lo=0 if echo else 1)
    logprobs = get_int(body, "logprobs", lo=0, hi=MAX_LOGPROBS)
    # vLLM's extra; echo with logprobs scores the prompt too (as OpenAI and vLLM do)
    prompt_logprobs = get_int(body, "prompt_logprobs", lo=0, hi=MAX_LOGPROBS)
    if prompt_logprobs is None and echo and logprobs is not None:
        prompt_logprobs = logprobs
    stream = get_bool(body, "stream")
    options = get_object(body, "stream_options")
    return CompletionRequest(
        model=model,
        prompts=prompts,
        params=sampling_params(
            body,
            max_tokens=max(max_tokens, 1),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        ),
        n=n,
        echo=echo,
        echo_only=echo and max_tokens == 0,
        stream=stream,
        include_usage=stream and get_bool(options, "include_usage"),
        return_token_ids=get_bool(body, "return_token_ids"),
        priority=get_int(body, "priority", 0),
    )


def _parse_prompt(prompt: object) -> list[str | list[int]]:
    """str | list[str] | list[int] | list[list[int]] -> one entry per prompt."""
    if prompt is None:
        raise CodecError("'prompt' is required", "prompt")
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise CodecError(
            "'prompt' must be a string, a list of strings, a list of token ids "
            "or a list of token-id lists, and must not be empty",
            "prompt",
        )
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(is_int(t) for t in prompt):
        return [list(prompt)]
    if all(isinstance(p, list) and p and all(is_int(t) for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise CodecError(
        "'prompt' must be a string, a list of strings, a list of token ids or a list of "
        "non-empty token-id lists (no mixing)",
        "prompt",
    )


async def tokenize_prompts(
    prompts: list[str | list[int]], tokenizer: TextTokenizer | None
) -> list[list[int]]:
    texts = [p for p in prompts if isinstance(p, str)]
    if texts and tokenizer is None:
        raise CodecError("this model has no tokenizer; send the prompt as token ids", "prompt")
    if sum(len(t) for t in texts) > _TOKENIZE_IN_THREAD_CHARS:
        return await asyncio.to_thread(_tokenize, prompts, tokenizer)
    return _tokenize(prompts, tokenizer)


def _tokenize(prompts: list[str | list[int]], tokenizer: TextTokenizer | None) -> list[list[int]]:
    return [tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]  # type: ignore[union-attr]

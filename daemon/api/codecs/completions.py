"""The /v1/completions codec: a parsed body -> its prompts tokenized, one job per prompt and
choice, and the answer that makes text_completion objects of their outputs."""

from __future__ import annotations

import time
import uuid
from functools import partial

from daemon.api.codecs.base import Call, JsonObject
from daemon.api.codecs.completions_answer import CompletionAnswer
from daemon.api.codecs.completions_request import (
    CompletionRequest,
    parse_completion_request,
    tokenize_prompts,
)
from daemon.models.tokenizer import TextTokenizer


class CompletionsCodec:
    """Completions on any model; `tokenizer` None: prompts must come as token ids."""

    def __init__(self, tokenizer: TextTokenizer | None, served_name: str) -> None:
        self.tokenizer = tokenizer
        self.served_name = served_name

    def parse(self, body: JsonObject) -> CompletionRequest:
        return parse_completion_request(body)

    async def decode(self, request: CompletionRequest) -> Call:
        prompt_ids = await tokenize_prompts(request.prompts, self.tokenizer)
        jobs = [(ids, request.params_for(j)) for ids in prompt_ids for j in range(request.n)]
        texts = [
            _echoed(p, ids, self.tokenizer) if request.echo else ""
            for p, ids in zip(request.prompts, prompt_ids)
        ]
        api_id = f"cmpl-{uuid.uuid4().hex}"
        answer = partial(
            CompletionAnswer,
            api_id,
            int(time.time()),
            self.served_name,
            request,
            prompt_ids,
            texts,
            self.tokenizer,
        )
        return Call(api_id, jobs, request.stream, answer, request.priority)


def _echoed(prompt: str | list[int], ids: list[int], tokenizer: TextTokenizer | None) -> str:
    """The prompt's text, as an echo shows it (token-id prompts are decoded)."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.decode(ids) if tokenizer is not None else ""

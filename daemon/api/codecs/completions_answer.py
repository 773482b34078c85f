"""Engine outputs -> OpenAI text_completion objects, whole or as stream chunks (with vLLM's
token ids and prompt logprobs)."""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson

from daemon.api.codecs.base import ABORTED, Event
from daemon.api.codecs.completions_request import CompletionRequest
from daemon.api.codecs.logprobs import completion_logprobs, vllm_prompt_logprobs
from daemon.api.codecs.usage import prompt_tokens_details
from daemon.loop.request import FinishReason, RequestOutput, TokenLogprob
from daemon.models.tokenizer import TextTokenizer


@dataclass
class CompletionChoice:
    index: int
    prompt_ids: list[int]
    prompt_text: str = ""  # echoed before the completion
    echo_only: bool = False  # the prompt alone: the one token computed is not part of the answer
    prompt_logprobs: list[TokenLogprob | None] | None = None
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text_offset: int = 0  # streaming: where the next chunk's logprobs start
    streamed: bool = False  # streaming: a chunk of this choice has been sent
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)

    def add(self, out: RequestOutput) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if not self.echo_only:
            self.text.append(out.new_text)
            self.token_ids.extend(out.new_token_ids)
            self.logprobs.extend(out.logprobs or [])
            self.num_output_tokens = out.num_output_tokens
        self.num_cached_tokens = out.num_cached_tokens
        self.cached_tokens_by_tier = out.cached_tokens_by_tier or {}
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
            if self.echo_only and out.finish_reason is not FinishReason.ABORT:
                self.finish_reason, self.stop_reason = FinishReason.LENGTH, None


@dataclass
class CompletionAnswer:
    """One completion request's answer: its choices are (prompt i, sample j) -> index i*n + j."""

    id: str
    created: int
    model: str
    req: CompletionRequest
    prompt_ids: list[list[int]]
    prompt_texts: list[str]  # what an echo shows of each prompt ("" without echo)
    tokenizer: TextTokenizer | None
    choices: list[CompletionChoice] = field(init=False)
    aborted_message: str = field(default=ABORTED, init=False)
    error_event: str | None = field(default=None, init=False)
    done_marker: str | None = field(default="[DONE]", init=False)

    def __post_init__(self) -> None:
        n = self.req.n
        self.choices = [
            CompletionChoice(
                i, self.prompt_ids[i // n], self.prompt_texts[i // n], self.req.echo_only
            )
            for i in range(len(self.prompt_ids) * n)
        ]

    def header(self) -> dict:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
        }

    def usage(self) -> dict:
        prompt = sum(len(ids) for ids in self.prompt_ids)
        completion = sum(ch.num_output_tokens for ch in self.choices)
        firsts = self.choices[:: self.req.n]  # the n choices of a prompt share its prefix
        by_tier: dict[str, int] = {}
        for ch in firsts:
            for tier, n in ch.cached_tokens_by_tier.items():
                by_tier[tier] = by_tier.get(tier, 0) + n
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": prompt_tokens_details(
                sum(ch.num_cached_tokens for ch in firsts), by_tier
            ),
        }

    def add(self, index: int, out: RequestOutput) -> None:
        self.choices[index].add(out)

    def body(self) -> bytes:
        choices = []
        for ch in self.choices:
            choice = {
                "index": ch.index,
                "text": ch.prompt_text + "".join(ch.text),
                "logprobs": self._logprobs(ch, ch.logprobs, 0, first=True)[0],
                "finish_reason": ch.finish_reason.value if ch.finish_reason else None,
                "stop_reason": ch.stop_reason,
            }
            if self.req.params.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(
                    ch.prompt_logprobs or [], self.tokenizer
                )
            if self.req.return_token_ids:
                choice |= {"prompt_token_ids": ch.prompt_ids, "token_ids": ch.token_ids}
            choices.append(choice)
        return orjson.dumps(self.header() | {"choices": choices, "usage": self.usage()})

    def opening(self) -> list[Event]:
        return []

    def events(self, index: int, out: RequestOutput) -> list[Event]:
        ch = self.choices[index]
        ch.add(out)
        if not (out.new_token_ids or out.new_text or out.finished):
            return []
        text, token_ids, entries = out.new_text, out.new_token_ids, out.logprobs
        if ch.echo_only:
            text, token_ids, entries = "", [], []
        if not ch.streamed:
            text = ch.prompt_text + text
        finish = ch.finish_reason if out.finished else None
        choice = {
            "index": index,
            "text": text,
            "logprobs": None,
            "finish_reason": finish.value if finish else None,
            "stop_reason": ch.stop_reason if out.finished else None,
        }
        choice["logprobs"], ch.text_offset = self._logprobs(
            ch, entries, ch.text_offset, first=not ch.streamed
        )
        if self.req.return_token_ids:
            if not ch.streamed:
                choice["prompt_token_ids"] = ch.prompt_ids
            choice["token_ids"] = token_ids
        ch.streamed = True
        return [(self.header() | {"choices": [choice]}, None)]

    def closing(self) -> list[Event]:
        if not self.req.include_usage:
            return []
        return [(self.header() | {"choices": [], "usage": self.usage()}, None)]

    def close(self) -> None:
        """Nothing to release: the choices are plain data."""

    def _logprobs(
        self, ch: CompletionChoice, entries: list[TokenLogprob] | None, offset: int, first: bool
    ) -> tuple[dict | None, int]:
        """The legacy logprobs of these output tokens; with echo, the first part (a whole
        answer or the first chunk) starts with the prompt's."""
        top_n = self.req.params.logprobs
        if top_n is None or entries is None:
            return None, offset
        unscored: list[int] = []
        if self.req.echo and first and ch.prompt_logprobs:
            unscored = ch.prompt_ids[:1]
            entries = [e for e in ch.prompt_logprobs[1:] if e is not None] + entries
        return completion_logprobs(entries, self.tokenizer, offset, unscored=unscored, top_n=top_n)

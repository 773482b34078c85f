"""Stage 3 of the loop: sampled tokens -> stop checks -> detokenize -> per-request output queues."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from weakref import WeakKeyDictionary

from daemon.loop.detokenizer import IncrementalDetokenizer
from daemon.loop.request import FinishReason, Request, RequestOutput, TokenLogprob
from daemon.models.tokenizer import TextTokenizer


@dataclass
class _Live:
    """An unfinished request's detokenizer and output queue."""

    detok: IncrementalDetokenizer
    queue: asyncio.Queue[RequestOutput]


class OutputProcessor:
    """Owns each request's output queue: found by request id while the request runs, and by
    the Request for as long as it lives (a stream may start after it finished)."""

    def __init__(self, tokenizer: TextTokenizer | None, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._live: dict[str, _Live] = {}
        self._queues: WeakKeyDictionary[Request, asyncio.Queue[RequestOutput]] = WeakKeyDictionary()

    def add(self, req: Request) -> None:
        detok = IncrementalDetokenizer(
            self.tokenizer, req.params.stop, req.params.include_stop_str_in_output
        )
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._live[req.request_id] = _Live(detok, queue)
        self._queues[req] = queue

    def remove(self, req: Request) -> None:
        self._live.pop(req.request_id, None)

    def queue(self, req: Request) -> asyncio.Queue[RequestOutput]:
        """The request's outputs, its last one `finished`."""
        return self._queues[req]

    def append_token(
        self, req: Request, token: int, logprob: TokenLogprob | None
    ) -> FinishReason | None:
        """Record one sampled token; returns why the request finished, if it did."""
        req.output_ids.append(token)
        if logprob is not None:
            req.output_logprobs.append(logprob)
        p = req.params
        stop_str = self._live[req.request_id].detok.add(token)
        if not p.ignore_eos and token in req.eos_token_ids:
            return FinishReason.STOP
        if token in p.stop_token_ids:
            req.stop_reason = token
            return FinishReason.STOP
        if stop_str is not None:
            req.stop_reason = stop_str
            return FinishReason.STOP
        if len(req.output_ids) >= p.max_tokens or req.num_known_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def emit(
        self,
        req: Request,
        new_ids: list[int],
        new_logprobs: list[TokenLogprob],
        finish: FinishReason | None,
    ) -> None:
        live = self._live[req.request_id]
        text = live.detok.take(final=finish is not None)
        out = RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_ids,
            new_text=text,
            logprobs=new_logprobs if req.params.logprobs is not None else None,
            finished=finish is not None,
            finish_reason=finish,
            stop_reason=req.stop_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=len(req.output_ids),
            num_cached_tokens=req.cache.num_cached_tokens,
            cached_tokens_by_tier=req.cache.tokens_by_tier or None,
            prompt_logprobs=req.prompt_logprobs
            if req.params.prompt_logprobs is not None and len(req.output_ids) == len(new_ids)
            else None,
        )
        live.queue.put_nowait(out)

    def emit_abort(self, req: Request) -> None:
        """The aborted request's last output (it may have finished running already)."""
        self._queues[req].put_nowait(
            RequestOutput(
                req.request_id,
                [],
                "",
                None,
                True,
                FinishReason.ABORT,
                num_prompt_tokens=req.num_prompt_tokens,
                num_output_tokens=len(req.output_ids),
            )
        )

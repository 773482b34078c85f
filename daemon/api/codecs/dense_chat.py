"""The /v1/chat/completions codec for dense families: the checkpoint's chat template renders
the prompt, the engine's own detokenizer and stop handling make the text, tools are held to the
template's call format by a grammar when they are forced."""

from __future__ import annotations

import asyncio
import time
import uuid
from functools import partial

from daemon.api.codecs.base import Call, CodecError, JsonObject
from daemon.api.codecs.chat_template import ChatTemplate
from daemon.api.codecs.completions_request import MAX_N
from daemon.api.codecs.constraints import Constraints, Grammar
from daemon.api.codecs.dense_chat_answer import DenseChatAnswer
from daemon.api.codecs.dense_tools import ToolRequest, tool_request
from daemon.api.codecs.images import (
    ImageReader,
    ImageRef,
    chat_image_refs,
    expand_placeholders,
)
from daemon.api.codecs.jobs import sample_jobs
from daemon.api.codecs.params import get_bool, get_int, get_object, sampling_params
from daemon.loop.image_input import ImageInput


class DenseChatCodec:
    """Chat Completions on a dense model served as `served_name`; `constraints` compile the
    grammars of forced tool calls and `response_format`."""

    def __init__(
        self,
        template: ChatTemplate,
        constraints: Constraints | None,
        served_name: str,
        max_model_len: int,
        images: ImageReader | None = None,
    ) -> None:
        """`images`: reads `image_url` parts for a vision model (None: the model takes none)."""
        self.template = template
        self.images = images
        self.constraints = constraints
        self.served_name = served_name
        self.max_model_len = max_model_len

    async def decode(self, body: JsonObject) -> Call:
        n = get_int(body, "n", 1, lo=1, hi=MAX_N) or 1
        tools = tool_request(body)
        parser = self.template.tool_parser if tools.active else None
        if tools.active and parser is None:
            raise CodecError(
                "this model's chat template has no tool-call format; set server.tool_call_parser "
                "(hermes or llama3_json) or send tool_choice none",
                "tools",
            )
        prompt_ids, images = await self._prompt(body, tools)
        limit = get_int(body, "max_completion_tokens", lo=1) or get_int(body, "max_tokens", lo=1)
        max_tokens = limit or max(1, self.max_model_len - len(prompt_ids))
        want_logprobs = get_bool(body, "logprobs")
        top = get_int(body, "top_logprobs", 0, lo=0, hi=20)
        params = sampling_params(
            body, max_tokens=max_tokens, logprobs=top if want_logprobs else None
        )
        grammar: Grammar | None = None
        if tools.forced and parser is not None:
            assert self.constraints is not None  # a chat template implies a tokenizer
            # tool_choice required or named: the output is calls in the template's format
            single = tools.choice == "named" or not tools.parallel
            grammar = await self.constraints.for_forced_calls(
                parser, tools.forced_tools(), single=single
            )
        elif self.constraints is not None:
            grammar = await self.constraints.for_response_format(body.get("response_format"))
        stream = get_bool(body, "stream")
        include_usage = get_bool(get_object(body, "stream_options"), "include_usage")
        api_id = f"chatcmpl-{uuid.uuid4().hex}"
        answer = partial(
            DenseChatAnswer,
            api_id,
            int(time.time()),
            self.served_name,
            len(prompt_ids),
            self.template.tokenizer,
            want_logprobs,
            include_usage,
            n,
            stream,
            parser,
        )
        jobs = sample_jobs(prompt_ids, params, n, grammar)
        return Call(api_id, jobs, stream, answer, images=images)

    async def _prompt(
        self, body: JsonObject, tools: ToolRequest
    ) -> tuple[list[int], list[ImageInput]]:
        return await self.prompt(body, tools, chat_image_refs(body))

    @property
    def image_text(self) -> str | None:
        """How an image is written in the template's text (the model's image token); None:
        the model takes no images."""
        if self.images is None:
            return None
        return self.template.tokenizer.token_text(self.images.image_token_id)

    async def prompt(
        self, body: JsonObject, tools: ToolRequest, refs: list[ImageRef]
    ) -> tuple[list[int], list[ImageInput]]:
        """The prompt's ids and its images `refs` (read and checked), both off the event
        loop (rendering and tokenizing a long conversation takes a while too). The messages'
        text holds one image token per image (image_url parts are rendered as one)."""
        reader = self.images
        if reader is None:
            if refs:
                raise CodecError("this model does not take images", refs[0].param)
            return await asyncio.to_thread(self.template.encode, body, tools), []
        reader.check_count(refs)
        ids = await asyncio.to_thread(self.template.encode, body, tools, self.image_text or "")
        ids, starts = expand_placeholders(
            ids, reader.image_token_id, reader.image_tokens, len(refs)
        )
        if not refs:
            return ids, []
        try:
            read = await asyncio.wait_for(
                asyncio.to_thread(reader.read, refs), reader.limits.fetch_timeout_s
            )
        except TimeoutError:
            raise CodecError(
                f"the images could not be read within {reader.limits.fetch_timeout_s} s",
                refs[0].param,
            ) from None
        return ids, [
            reader.input(r.digest, r.data, s, ref.param) for r, s, ref in zip(read, starts, refs)
        ]

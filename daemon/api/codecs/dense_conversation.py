"""/v1/responses and /v1/messages on dense families: deepseek-recipe converts and checks the body
(images included: Responses `input_image`, Messages `image` blocks), the checkpoint's chat
template renders the conversation as Chat Completions would, the images go the chat path's way,
and the recipe's stream processor writes the protocol's answer from the text."""

from __future__ import annotations

import asyncio
import uuid
from functools import cached_property
from typing import Any

import deepseek_recipe as dr

from daemon.api.codecs.base import Call, CodecError, JsonObject
from daemon.api.codecs.dense_chat import DenseChatCodec
from daemon.api.codecs.dense_tools import tool_request
from daemon.api.codecs.images import source_refs
from daemon.api.codecs.jobs import sample_jobs
from daemon.api.codecs.recipe.answer import RecipeAnswer
from daemon.api.codecs.recipe.codec import (
    MESSAGES,
    RESPONSES,
    Prepared,
    Protocol,
    adapt,
    sampling_params,
)
from daemon.api.codecs.recipe.stream import OutputStream
from daemon.api.codecs.recipe.turn import Turn
from daemon.api.codecs.response_store import ResponseStore

_NOT_SERVED = "on this model only through /v1/chat/completions"


class DenseConversationCodec:
    """RESPONSES or MESSAGES over `chat`'s template and image reader: text and images in, text
    out. Tools, thinking, structured output and continuing an assistant turn are refused (400);
    Chat Completions has the tools of a dense model."""

    def __init__(
        self,
        chat: DenseChatCodec,
        protocol: Protocol,
        eos_token_ids: tuple[int, ...],
        store: ResponseStore,
    ) -> None:
        assert protocol in (RESPONSES, MESSAGES)
        self.chat, self.protocol = chat, protocol
        self.eos_token_ids, self.store = eos_token_ids, store
        # images are written in the converted text as the model's image token, as chat does
        specials = dr.SpecialTokens(image=chat.image_text) if chat.image_text else None
        options = (
            dr.ConversionOptions()
            # the version whose conversion keeps images (V4 Pro's writes them as text)
            .with_model_alias(chat.served_name, dr.ModelVersion.DeepseekV41Flash)
            .with_default_thinking_mode(False)
        )
        self.options = options.with_special_tokens(specials) if specials else options

    async def decode(self, body: JsonObject) -> Call:
        turn = None
        if self.protocol is RESPONSES:  # `store`, and `previous_response_id`'s conversation
            body, turn = Turn.begin(self.store, body)
        rid = self.protocol.id_prefix + uuid.uuid4().hex
        conv, echo = await asyncio.to_thread(self._convert, body)
        messages, refs = _template_messages(conv.conversation)
        ids, images = await self.chat.prompt({"messages": messages}, tool_request({}), refs)
        try:
            max_tokens = conv.resolve_max_tokens(len(ids), self.chat.max_model_len)
        except dr.ConversionError as e:
            raise CodecError(str(e)) from None
        prepared = Prepared(
            self.protocol, rid, conv, ids, sampling_params(conv, max_tokens), None, echo
        )
        await asyncio.to_thread(lambda: self.tokenizer)  # made off the loop, once
        jobs = sample_jobs(ids, prepared.params, 1)
        return Call(rid, jobs, prepared.stream, lambda: self._answer(prepared, turn), images=images)

    def _convert(self, body: JsonObject) -> tuple[dr.ConversationRequest, dr.ResponsesEcho | None]:
        try:
            request = self.protocol.request_cls(adapt(self.protocol, body))
            echo = request.echo() if self.protocol is RESPONSES else None
            conv = request.convert(self.options)
        except (dr.ConversionError, ValueError) as e:
            raise CodecError(str(e)) from None
        c = conv.conversation
        if c.tools:
            raise CodecError(f"tools are served {_NOT_SERVED}", "tools")
        if c.thinking_mode:
            raise CodecError("this model does not think: ask for no thinking or reasoning")
        if conv.inference_options.output_constraint is not None:
            raise CodecError(f"structured output is served {_NOT_SERVED}")
        return conv, echo

    @cached_property
    def tokenizer(self) -> dr.Tokenizer:
        """The recipe's copy of the model's tokenizer (its stream processor decodes with it);
        made at the first request, not at every dense server's start."""
        return dr.Tokenizer.from_str(self.chat.template.tokenizer.tokenizer.to_str())

    def _answer(self, prepared: Prepared, turn: Turn | None) -> RecipeAnswer:
        conv = prepared.conversation
        generator: Any = self.protocol.request_cls.chunk_generator(
            conv, prepared.request_id, self.chat.served_name
        )
        if prepared.echo is not None:
            generator = generator.with_echo(prepared.echo)
        # plain text: the model writes no DeepSeek tool-call markup
        parsing = dr.ParsingOptions(
            parse_tool_calls=False, stop_sequences=conv.parsing_options.stop_sequences
        )
        processor = dr.StreamProcessor(generator, parsing, self.tokenizer)
        out = OutputStream(processor, self.eos_token_ids, len(prepared.prompt_ids))
        return RecipeAnswer(self.protocol, prepared.request_id, self.chat.served_name, [out], turn)


def _template_messages(conv: dr.Conversation) -> tuple[list[dict[str, str]], list[Any]]:
    """The conversation as a chat template's messages (text holding each image's token) and
    its images in order. The recipe makes each Messages content block a message of its own;
    consecutive ones of a role are one turn, joined by a blank line as DeepSeek's encoding
    joins them (and as the recipe joins a Responses message's parts)."""
    messages: list[dict[str, str]] = []
    sources = []
    for i, m in enumerate(conv.messages):
        if m.role not in ("system", "user", "assistant"):
            raise CodecError(f"{m.role} messages are served {_NOT_SERVED}", f"messages[{i}]")
        if m.tool_calls:
            raise CodecError(f"tool calls are served {_NOT_SERVED}", f"messages[{i}]")
        if m.prefix:
            raise CodecError(
                "continuing an assistant message is not served on this model", f"messages[{i}]"
            )
        if messages and messages[-1]["role"] == m.role and m.role != "assistant":
            messages[-1]["content"] += "\n\n" + m.content
        else:
            messages.append({"role": m.role, "content": m.content})
        sources += m.image_sources
    return messages, source_refs(sources)

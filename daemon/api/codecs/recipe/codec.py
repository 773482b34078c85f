"""Protocol body -> deepseek-recipe conversation -> prompt ids and sampling parameters."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import deepseek_recipe as dr

from daemon.api.codecs.base import CodecError
from daemon.api.codecs.recipe.bodies import Body, chat_body, messages_body
from daemon.loop.request import SamplingParams
from daemon.models.tokenizer import TextTokenizer

Generator = dr.ChatCompletionChunkGenerator | dr.ResponsesChunkGenerator | dr.MessagesChunkGenerator
Accumulator = dr.ChatCompletionResponse | dr.ResponsesResponse | dr.MessagesResponse


@dataclass(frozen=True)
class Protocol:
    """One wire protocol: its recipe request and response classes and its id prefix."""

    name: str
    request_cls: Any
    response_cls: Any
    id_prefix: str


CHAT = Protocol("chat", dr.ChatCompletionRequest, dr.ChatCompletionResponse, "chatcmpl-")
RESPONSES = Protocol("responses", dr.ResponsesRequest, dr.ResponsesResponse, "resp_")
MESSAGES = Protocol("messages", dr.MessagesRequest, dr.MessagesResponse, "msg_")
THINKING_DEFAULTS = ("auto", "on", "off")  # auto: per protocol (thinks_by_default)


@dataclass
class Prepared:
    """A converted request, ready for the engine."""

    protocol: Protocol
    request_id: str
    conversation: dr.ConversationRequest
    prompt_ids: list[int]
    params: SamplingParams
    constraint: dr.OutputConstraint | None
    echo: dr.ResponsesEcho | None = None

    @property
    def stream(self) -> bool:
        return self.conversation.stream

    @property
    def parsing_options(self) -> dr.ParsingOptions:
        return self.conversation.parsing_options


class RecipeCodec:
    """Converts and encodes requests for a DeepSeek-V4 model served as `served_name`."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        served_name: str,
        context_limit: int,
        thinking_default: str = "auto",
    ) -> None:
        """`thinking_default` (one of THINKING_DEFAULTS): whether a request that does not say
        thinks."""
        self.tokenizer = dr.Tokenizer.from_str(tokenizer.tokenizer.to_str())
        self.served_name = served_name
        self.context_limit = context_limit
        options = dr.ConversionOptions().with_model_alias(
            served_name, dr.ModelVersion.DeepseekV4Pro
        )
        self.options = {
            p.name: options.with_default_thinking_mode(thinks_by_default(thinking_default, p))
            for p in (CHAT, RESPONSES, MESSAGES)
        }
        self.encoding = dr.DeepseekV4Encoding().with_tokenizer(self.tokenizer)
        end = dr.SpecialToken.ThinkingEnd.default_str()
        self.think_end_id: int | None = tokenizer.tokenizer.token_to_id(end)

    def prepare(self, protocol: Protocol, body: dict[str, Any], request_id: str) -> Prepared:
        """Raises CodecError for anything the client got wrong. Encoding a long conversation
        takes a while (it releases the GIL): call it off the event loop."""
        try:
            request = protocol.request_cls(adapt(protocol, body))
            echo = request.echo() if protocol is RESPONSES else None
            conv = request.convert(self.options[protocol.name])
            prompt_ids = self.encoding.encode(conv.conversation)
            max_tokens = conv.resolve_max_tokens(len(prompt_ids), self.context_limit)
        except dr.ConversionError as e:
            raise CodecError(str(e)) from None
        except ValueError as e:  # malformed body (missing or mistyped fields)
            raise CodecError(str(e)) from None
        return Prepared(
            protocol=protocol,
            request_id=request_id,
            conversation=conv,
            prompt_ids=prompt_ids,
            params=sampling_params(conv, max_tokens),
            constraint=conv.inference_options.output_constraint,
            echo=echo,
        )

    def encode_chat(self, body: dict[str, Any]) -> list[int]:
        """The prompt ids of a Chat Completions body (for /tokenize)."""
        return self._encode(CHAT, body, chat_body, "messages")

    def count_messages(self, body: dict[str, Any]) -> int:
        """The prompt tokens of a Messages body, which needs no `max_tokens` (count_tokens)."""
        return len(self._encode(MESSAGES, body, partial(messages_body, counting=True)))

    def _encode(
        self,
        protocol: Protocol,
        body: dict[str, Any],
        adapt_body: Callable[[Body], Body],
        param: str | None = None,
    ) -> list[int]:
        """CodecError naming `param`, if given, for a body that does not convert."""
        try:
            request = protocol.request_cls(adapt_body(body))
            conv = request.convert(self.options[protocol.name])
            return self.encoding.encode(conv.conversation)
        except (dr.ConversionError, ValueError) as e:
            raise CodecError(str(e), param) from None

    def processor(self, prepared: Prepared) -> dr.StreamProcessor:
        """A parser for one generated choice (each choice needs its own)."""
        generator: Generator = prepared.protocol.request_cls.chunk_generator(
            prepared.conversation, prepared.request_id, self.served_name
        )
        if prepared.echo is not None:
            generator = generator.with_echo(prepared.echo)
        return dr.StreamProcessor(generator, prepared.parsing_options, self.tokenizer)


def thinks_by_default(setting: str, protocol: Protocol) -> bool:
    """auto: as each protocol's own service does: Messages thinks only when asked (Anthropic);
    Chat Completions and Responses think unless told not to (DeepSeek's API, effort high)."""
    if setting == "auto":
        return protocol is not MESSAGES
    return setting == "on"


def adapt(protocol: Protocol, body: dict[str, Any]) -> dict[str, Any]:
    if protocol is CHAT:
        return chat_body(body)
    if protocol is MESSAGES:
        return messages_body(body)
    return body


def sampling_params(conv: dr.ConversationRequest, max_tokens: int) -> SamplingParams:
    io = conv.inference_options
    logprobs = (io.top_logprobs or 0) if io.logprobs else None
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if io.temperature is None else io.temperature,
        top_p=1.0 if io.top_p is None else io.top_p,
        seed=io.seed,
        logprobs=logprobs,
        # the engine stops at a stop string; the stream parser trims it
        stop=list(conv.parsing_options.stop_sequences),
        include_stop_str_in_output=True,
    )

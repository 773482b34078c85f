"""The codec of Chat Completions, Responses and Messages on DeepSeek-V4: a body -> the recipe's
conversation, its prompt ids and sampling parameters, the grammar of its output constraint, and
n choices of it (Chat Completions' `n`: the recipe takes one)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, replace

from daemon.api.codecs.base import Answer, Job, JsonObject
from daemon.api.codecs.completions_request import MAX_N
from daemon.api.codecs.constraints import Constraints, Grammar, OutputOptions
from daemon.api.codecs.jobs import sample_jobs
from daemon.api.codecs.params import get_bool, get_int, get_logit_bias, get_object
from daemon.api.codecs.recipe.answer import RecipeAnswer
from daemon.api.codecs.recipe.codec import CHAT, RESPONSES, Prepared, Protocol, RecipeCodec
from daemon.api.codecs.recipe.stream import OutputStream
from daemon.api.codecs.recipe.turn import Turn
from daemon.api.codecs.response_store import ResponseStore


@dataclass
class RecipeCall:
    id: str
    jobs: list[Job]
    codec: ConversationCodec
    prepared: Prepared
    turn: Turn | None  # Responses: the stored conversation
    include_usage: bool  # Chat Completions' stream_options.include_usage
    priority: int = 0

    @property
    def stream(self) -> bool:
        return self.prepared.stream

    def answer(self) -> Answer:
        """Its parsers are the recipe's (closed with the answer): one per choice."""
        codec, prepared = self.codec, self.prepared
        eos, prompt_len = codec.eos_token_ids, len(prepared.prompt_ids)
        outs = [OutputStream(codec.recipe.processor(prepared), eos, prompt_len) for _ in self.jobs]
        return RecipeAnswer(
            codec.protocol, self.id, codec.recipe.served_name, outs, self.turn, self.include_usage
        )


class ConversationCodec:
    """One of the recipe's protocols (CHAT, RESPONSES, MESSAGES); Responses keeps what it
    answers in `store`."""

    def __init__(
        self,
        recipe: RecipeCodec,
        protocol: Protocol,
        constraints: Constraints | None,
        eos_token_ids: tuple[int, ...],
        store: ResponseStore | None = None,
    ) -> None:
        assert protocol is not RESPONSES or store is not None
        self.recipe = recipe
        self.protocol = protocol
        self.constraints = constraints
        self.eos_token_ids = eos_token_ids
        self.store = store

    async def decode(self, body: JsonObject) -> RecipeCall:
        protocol = self.protocol
        n = 1
        if protocol is CHAT:  # the recipe takes n=1 only; the choices are ours
            n = get_int(body, "n", 1, lo=1, hi=MAX_N) or 1
            body = {k: v for k, v in body.items() if k != "n"}
        turn = None
        if protocol is RESPONSES:  # `store`, and `previous_response_id`'s conversation as input
            assert self.store is not None
            body, turn = Turn.begin(self.store, body)
        rid = protocol.id_prefix + uuid.uuid4().hex
        options, recipe_body = OutputOptions.read(protocol.name, body)
        # conversion and prompt encoding, in a worker thread: long conversations take a while
        prepared = await asyncio.to_thread(self.recipe.prepare, protocol, recipe_body, rid)
        if protocol is CHAT and (bias := get_logit_bias(body)):  # the recipe does not carry it
            prepared.params = replace(prepared.params, logit_bias=bias)
        grammar = await self._grammar(prepared, options)
        include_usage = protocol is CHAT and get_bool(
            get_object(body, "stream_options"), "include_usage"
        )
        jobs = sample_jobs(prepared.prompt_ids, prepared.params, n, grammar)
        return RecipeCall(rid, jobs, self, prepared, turn, include_usage)

    async def _grammar(self, prepared: Prepared, options: OutputOptions) -> Grammar | None:
        """The recipe's OutputConstraint as a grammar, enforced after the thinking block if any."""
        oc = prepared.constraint
        if oc is None or self.constraints is None:
            return None
        thinking = prepared.conversation.conversation.thinking_mode
        trigger = self.recipe.think_end_id if thinking else None
        return await self.constraints.for_recipe(oc, options, trigger)

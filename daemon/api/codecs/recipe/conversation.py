"""The codec of Chat Completions, Responses and Messages on DeepSeek-V4: a body -> the recipe's
conversation, its prompt ids and sampling parameters, the grammar of its output constraint, and
n choices of it (Chat Completions' `n`: the recipe takes one)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from functools import partial

from daemon.api.codecs.base import Call, JsonObject
from daemon.api.codecs.completions_request import MAX_N
from daemon.api.codecs.constraints import Constraints, Grammar, OutputOptions
from daemon.api.codecs.jobs import sample_jobs
from daemon.api.codecs.params import get_bool, get_int, get_logit_bias, get_object
from daemon.api.codecs.recipe.answer import RecipeAnswer
from daemon.api.codecs.recipe.codec import CHAT, RESPONSES, Prepared, Protocol, RecipeCodec
from daemon.api.codecs.recipe.stream import OutputStream
from daemon.api.codecs.recipe.turn import Turn
from daemon.api.codecs.response_store import ResponseStore


class ConversationCodec:
    """One of the recipe's protocols (CHAT, RESPONSES, MESSAGES); Responses keeps what it
    answers in `store` (with `store: true`), and continues what it kept there."""

    def __init__(
        self,
        recipe: RecipeCodec,
        protocol: Protocol,
        constraints: Constraints | None,
        eos_token_ids: tuple[int, ...],
        store: ResponseStore,
    ) -> None:
        self.recipe = recipe
        self.protocol = protocol
        self.constraints = constraints
        self.eos_token_ids = eos_token_ids
        self.store = store

    async def decode(self, body: JsonObject) -> Call:
        protocol = self.protocol
        n = 1
        if protocol is CHAT:  # the recipe takes n=1 only; the choices are ours
            n = get_int(body, "n", 1, lo=1, hi=MAX_N) or 1
            body = {k: v for k, v in body.items() if k != "n"}
        turn = None
        if protocol is RESPONSES:  # `store`, and `previous_response_id`'s conversation as input
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
        answer = partial(self._answer, prepared, n, turn, include_usage)
        return Call(rid, jobs, prepared.stream, answer)

    def _answer(
        self, prepared: Prepared, n: int, turn: Turn | None, include_usage: bool
    ) -> RecipeAnswer:
        """Its parsers are the recipe's (closed with the answer): one per choice."""
        prompt_len = len(prepared.prompt_ids)
        outs = [
            OutputStream(self.recipe.processor(prepared), self.eos_token_ids, prompt_len)
            for _ in range(n)
        ]
        return RecipeAnswer(
            self.protocol, prepared.request_id, self.recipe.served_name, outs, turn, include_usage
        )

    async def _grammar(self, prepared: Prepared, options: OutputOptions) -> Grammar | None:
        """The recipe's OutputConstraint as a grammar, enforced after the thinking block if any."""
        oc = prepared.constraint
        if oc is None or self.constraints is None:
            return None
        thinking = prepared.conversation.conversation.thinking_mode
        trigger = self.recipe.think_end_id if thinking else None
        return await self.constraints.for_recipe(oc, options, trigger)

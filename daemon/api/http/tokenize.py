"""POST /tokenize and /detokenize (vLLM-style): text or chat messages -> ids, ids -> text; and
POST /v1/messages/count_tokens (Anthropic's): the prompt tokens of a Messages body."""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web

from daemon.api.codecs.params import get_bool, get_int_list, get_str
from daemon.api.http.errors import bad_request
from daemon.api.http.state import ApiState, get_state, read_json_object
from daemon.models.tokenizer import TextTokenizer

routes = web.RouteTableDef()


@routes.post("/tokenize")
async def tokenize(request: web.Request) -> web.Response:
    state = get_state(request)
    body = await read_json_object(request)
    tok = _tokenizer(state, body)
    # rendering and encoding a long conversation or text takes a while: off the event loop
    if "messages" in body:
        ids = await asyncio.to_thread(_chat_ids, state, body)
    else:
        prompt = get_str(body, "prompt")
        if prompt is None:
            raise bad_request("give 'prompt' (a string) or 'messages'", "prompt")
        special = get_bool(body, "add_special_tokens", True)
        ids = await asyncio.to_thread(tok.encode, prompt, add_special_tokens=special)
    answer: dict = {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids}
    if get_bool(body, "return_token_strs"):
        answer["token_strs"] = [tok.token_text(t) for t in ids]
    return web.json_response(answer, dumps=lambda o: orjson.dumps(o).decode())


@routes.post("/detokenize")
async def detokenize(request: web.Request) -> web.Response:
    state = get_state(request)
    body = await read_json_object(request)
    tok = _tokenizer(state, body)
    ids = get_int_list(body, "tokens")
    if any(not 0 <= t < tok.vocab_size for t in ids):
        raise bad_request(f"token ids must lie in [0, {tok.vocab_size})", "tokens")
    text = tok.decode(ids, skip_special_tokens=False)
    return web.json_response({"prompt": text}, dumps=lambda o: orjson.dumps(o).decode())


@routes.post("/v1/messages/count_tokens")
async def count_tokens(request: web.Request) -> web.Response:
    state = get_state(request)
    body = await read_json_object(request)
    state.check_body_model(body)
    recipe = state.codecs.recipe
    if recipe is None:
        raise bad_request(f"{request.path} is not available for this model (it has no chat codec)")
    count = await asyncio.to_thread(recipe.count_messages, body)
    return web.json_response({"input_tokens": count})


def _tokenizer(state: ApiState, body: dict) -> TextTokenizer:
    model = get_str(body, "model")
    if model is not None:
        state.check_model(model)
    if state.engine.tokenizer is None:
        raise bad_request("this model has no tokenizer")
    return state.engine.tokenizer


def _chat_ids(state: ApiState, body: dict) -> list[int]:
    codecs = state.codecs
    if codecs.recipe is not None:
        return codecs.recipe.encode_chat(body | {"model": state.served_name})
    if codecs.chat_template is not None:
        return codecs.chat_template.encode(body)
    raise bad_request("this model has no chat template; give 'prompt'", "messages")


def register(app: web.Application) -> None:
    app.router.add_routes(routes)

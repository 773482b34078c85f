"""What every route handler shares: the engine, the served model name, the model's codecs, and
body reading."""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson
from aiohttp import web

from daemon.api.codecs.base import Codec, JsonObject
from daemon.api.codecs.chat_template import ChatTemplate
from daemon.api.codecs.completions import CompletionsCodec
from daemon.api.codecs.constraints import Constraints
from daemon.api.codecs.images import ImageReader
from daemon.api.codecs.recipe.codec import RecipeCodec
from daemon.api.http.errors import ApiError, bad_request, model_not_found, overloaded, unavailable
from daemon.loop.engine import Engine
from daemon.loop.metrics import EngineMetrics


@dataclass(frozen=True)
class Codecs:
    """What the model speaks: completions always; with a chat codec, `conversations` by the
    recipe's protocol names: chat, responses and messages through deepseek-recipe (DeepSeek-V4),
    or through the checkpoint's own chat template (other families; responses and messages
    converted by the recipe: text and images only)."""

    completions: CompletionsCodec
    conversations: dict[str, Codec[JsonObject]] = field(default_factory=dict)
    recipe: RecipeCodec | None = None  # DeepSeek-V4: /tokenize's chat ids, count_tokens
    chat_template: ChatTemplate | None = None  # other families: /tokenize's chat ids
    constraints: Constraints | None = None  # structured output (xgrammar), closed with the app
    images: ImageReader | None = None  # a vision model's: image bytes to pixels (encoder route)


@dataclass
class ApiState:
    engine: Engine
    served_name: str
    demo: bool  # random-weight demo model: its output is noise
    created: int  # unix time the server started, shown as the model's `created`
    codecs: Codecs
    max_waiting: int = 0  # 429 once this many requests wait for the engine (0 = no limit)
    api_key: str | None = field(default=None, repr=False)
    metrics: EngineMetrics | None = None
    draining: bool = False  # shutting down: finish what runs, admit nothing new
    stopping: bool = False  # the server is closing its connections: what it cuts is ours

    def check_model(self, model: str) -> None:
        if model != self.served_name:
            raise model_not_found(model)

    def check_body_model(self, body: dict) -> None:
        """The body's `model` is a string naming the model served here."""
        model = body.get("model")
        if not isinstance(model, str):
            raise bad_request("'model' must be a string", "model")
        self.check_model(model)

    def check_engine(self) -> None:
        if self.draining:
            raise unavailable("the server is shutting down; retry on another node", 5)
        if self.engine.error is not None:
            raise unavailable("the inference engine has failed; the server must be restarted")

    def check_capacity(self) -> None:
        if self.max_waiting and len(self.engine.scheduler.waiting) >= self.max_waiting:
            raise overloaded()


# serde_json's recursion limit, which deepseek-recipe's codec (and so every protocol) inherits
MAX_JSON_DEPTH = 128

STATE: web.AppKey[ApiState] = web.AppKey("deepinfer_state", ApiState)


def get_state(request: web.Request) -> ApiState:
    return request.app[STATE]


async def read_json_object(request: web.Request) -> dict:
    """The body as a JSON object; 400 for anything else (413 comes from aiohttp's own limit)."""
    raw = await request.read()
    if not raw:
        raise bad_request("the request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        if "depth limit" in str(e):  # orjson's own, at 1024
            raise _too_deep() from None
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    # (counting brackets, strings included, is quick and rules out most bodies)
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and json_depth(body) > MAX_JSON_DEPTH:
        raise _too_deep()
    return body


def _too_deep() -> ApiError:
    return bad_request(
        f"the request body is nested more than {MAX_JSON_DEPTH} levels deep (objects and arrays)"
    )


def json_depth(value: object) -> int:
    """How many objects / arrays deep `value` nests (0 for a scalar); without recursion."""
    deepest = 0
    todo: list[tuple[dict | list, int]] = [(value, 1)] if isinstance(value, (dict, list)) else []
    while todo:
        node, depth = todo.pop()
        deepest = max(deepest, depth)
        children = node.values() if isinstance(node, dict) else node
        todo.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest

"""What every route handler shares: the engine, the served model name, and body reading."""

from __future__ import annotations

from dataclasses import dataclass

import orjson
from aiohttp import web

from daemon.api.errors import bad_request, model_not_found, unavailable
from daemon.loop.engine import Engine


@dataclass
class ApiState:
    engine: Engine
    served_name: str
    demo: bool  # random-weight demo model: its output is noise
    created: int  # unix time the server started, shown as the model's `created`

    def check_model(self, model: str) -> None:
        if model != self.served_name:
            raise model_not_found(model)

    def check_engine(self) -> None:
        if self.engine.error is not None:
            raise unavailable("the inference engine has failed; the server must be restarted")


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
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body

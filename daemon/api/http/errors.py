"""Error objects in each protocol's shape (OpenAI's, Anthropic's for /v1/messages), the ApiError
exception handlers raise, and the middleware that turns every failure (a codec's CodecError
among them) into that shape."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

import orjson
import structlog
from aiohttp import web

from daemon.api.codecs.base import CodecError

log = structlog.get_logger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]


class ErrorCounter(Protocol):
    """Where the answered errors are counted (the /metrics error counter)."""

    def on_error(self, status: int, kind: str) -> None: ...


_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
ANTHROPIC_PATHS = ("/v1/messages",)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def anthropic_error_body(status: int, message: str) -> dict:
    type_ = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": type_, "message": message}}


def error_response(
    status: int,
    message: str,
    *,
    type_: str | None = None,
    param: str | None = None,
    code: str | None = None,
    anthropic: bool = False,
    headers: dict[str, str] | None = None,
) -> web.Response:
    if anthropic:
        body = anthropic_error_body(status, message)
    else:
        body = error_body(message, type_ or error_type(status), param, code)
    return web.Response(
        status=status, body=orjson.dumps(body), content_type="application/json", headers=headers
    )


def error_type(status: int) -> str:
    """The OpenAI error type of a status."""
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")


class ApiError(Exception):
    """Raised by handlers; the middleware answers it with the error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type_ = (
            status,
            message,
            param,
            code,
            type_,
        )
        self.headers = headers

    def response(self, anthropic: bool = False) -> web.Response:
        return error_response(
            self.status,
            self.message,
            type_=self.type_,
            param=self.param,
            code=self.code,
            anthropic=anthropic,
            headers=self.headers,
        )

    def body(self) -> dict:
        type_ = self.type_ or _TYPES.get(self.status, "invalid_request_error")
        return error_body(self.message, type_, self.param, self.code)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def from_codec(e: CodecError) -> ApiError:
    return ApiError(400, e.message, param=e.param, code=e.code)


def unauthorized() -> ApiError:
    return ApiError(401, "Invalid or missing API key.", code="invalid_api_key")


def model_not_found(model: str) -> ApiError:
    return ApiError(
        404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
    )


def too_large(message: str) -> ApiError:
    return ApiError(413, message, code="request_too_large")


def overloaded(retry_after_s: int = 1) -> ApiError:
    return ApiError(
        429,
        "The server is overloaded: too many requests are waiting. Retry later.",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(retry_after_s)},
    )


def unavailable(message: str, retry_after_s: int | None = None) -> ApiError:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return ApiError(503, message, code="service_unavailable", headers=headers)


def internal_error() -> ApiError:
    return ApiError(500, "The server had an error while processing your request.")


def is_anthropic(request: web.Request) -> bool:
    return request.path.startswith(ANTHROPIC_PATHS)


def counting_errors(counter: ErrorCounter | None) -> Middleware:
    """The middleware that answers every failure in its protocol's shape, counting each answered
    error (status, type) on `counter`."""

    def count(status: int, kind: str) -> None:
        if counter is not None:
            counter.on_error(status, kind)

    @web.middleware
    async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        anthropic = is_anthropic(request)
        try:
            return await handler(request)
        except CodecError as e:
            count(400, error_type(400))
            return from_codec(e).response(anthropic)
        except ApiError as e:
            count(e.status, e.type_ or error_type(e.status))
            return e.response(anthropic)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            count(e.status, error_type(e.status))
            return error_response(e.status, _http_message(request, e), anthropic=anthropic)
        except ConnectionResetError:  # the client went away; nobody reads this answer
            log.info("client_disconnected", method=request.method, path=request.path)
            return web.Response(status=499)
        except Exception:
            log.exception("unhandled_error", method=request.method, path=request.path)
            count(500, error_type(500))
            return internal_error().response(anthropic)

    return error_middleware


error_middleware = counting_errors(None)  # counting nothing (the admin socket)


def _http_message(request: web.Request, e: web.HTTPException) -> str:
    if e.status in (404, 405):
        return f"Invalid URL ({request.method} {request.path})"
    if isinstance(e, web.HTTPRequestEntityTooLarge):
        return f"Request body too large: {e.text}"
    return e.reason

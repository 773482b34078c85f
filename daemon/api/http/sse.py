"""Server-sent events: open a text/event-stream response and write orjson-encoded events."""

from __future__ import annotations

import orjson
from aiohttp import web

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


class SSEWriter:
    """Writes `data: {json}` events (with an optional `event:` line, as Anthropic's API uses)."""

    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response

    @classmethod
    async def open(cls, request: web.Request) -> SSEWriter:
        response = web.StreamResponse(status=200, headers=SSE_HEADERS)
        await response.prepare(request)
        return cls(response)

    async def send(self, data: object, event: str | None = None) -> None:
        head = b"event: " + event.encode() + b"\n" if event else b""
        await self.response.write(head + b"data: " + orjson.dumps(data) + b"\n\n")

    async def send_raw(self, data: str, event: str | None = None) -> None:
        """An event whose data is already serialised (protocol chunks' own to_json())."""
        head = "event: " + event + "\n" if event else ""
        await self.response.write((head + "data: " + data + "\n\n").encode())

    async def close(self) -> None:
        await self.response.write_eof()

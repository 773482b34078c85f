"""TTFT and TPOT of one proxied SSE stream, as the router sees it: the first and last events
that carry generated output (each protocol's opening and closing events are left out)."""

from __future__ import annotations

from dataclasses import dataclass


def carries_output(path: str, event: bytes) -> bool:
    """Whether one SSE event (the bytes up to its blank line) carries generated output."""
    if path == "/v1/responses":
        return b"event: response." in event and b".delta\n" in event
    if path == "/v1/messages":
        return b"event: content_block_delta" in event
    if b"data: [DONE]" in event:
        return False
    if path == "/v1/chat/completions":  # the opening chunk names the role; the last has {}
        return b'"delta"' in event and b'"role"' not in event and b'"delta":{}' not in event
    return event.startswith(b"data:")


@dataclass
class StreamTiming:
    path: str
    started: float  # when the router got the request
    first: float | None = None
    last: float | None = None
    events: int = 0

    def feed(self, chunk: bytes, now: float) -> None:
        """`chunk`: whole events (the relay writes up to a blank line)."""
        for event in chunk.split(b"\n\n"):
            if event and carries_output(self.path, event):
                self.events += 1
                self.first = now if self.first is None else self.first
                self.last = now

    def ttft_s(self) -> float | None:
        return None if self.first is None else self.first - self.started

    def tpot_s(self) -> float | None:
        if self.first is None or self.last is None or self.events < 2:
            return None
        return (self.last - self.first) / (self.events - 1)

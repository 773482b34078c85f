"""The codec interface: a protocol's request body -> the engine requests it asks for (a Call);
their outputs -> the protocol's answer, whole or as stream events (an Answer)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from daemon.loop.image_input import ImageInput
from daemon.loop.request import RequestOutput, SamplingParams

JsonObject = dict[str, Any]
Job = tuple[list[int], SamplingParams]  # one engine request: prompt ids and sampling
# one stream event: its data (a str: already serialised; else JSON-encoded) and event name
Event = tuple[object, str | None]

ABORTED = (
    "the request was aborted before it finished (the server is shutting down or the engine failed)"
)


class CodecError(Exception):
    """The client's request cannot be served as sent (answered 400 in the protocol's shape);
    `param` names the field at fault, `code` is the protocol's error code, where there is one."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class Answer(Protocol):
    """Engine outputs -> one protocol answer. Output `index` is job `index`'s; a whole answer
    takes `add` for each and then `body`; a streamed one sends `opening`, the `events` of each
    output and, unless it was aborted, `closing`, then `done_marker` if any."""

    aborted_message: str  # said (a 503, or an error event) when an output ends aborted
    error_event: str | None  # the SSE event name of that error event
    done_marker: str | None  # the data of the stream's last event, if the protocol has one

    def add(self, index: int, out: RequestOutput) -> None: ...

    def body(self) -> bytes | str: ...

    def opening(self) -> list[Event]: ...

    def events(self, index: int, out: RequestOutput) -> list[Event]: ...

    def closing(self) -> list[Event]: ...

    def close(self) -> None:
        """Called once the answer is over, whatever ended it."""


@dataclass
class Call:
    """A request made ready for the engine: job i becomes engine request `{id}-{i}`; `answer`
    makes the answer of their outputs (once, when they are submitted)."""

    id: str  # the protocol object's id (cmpl-..., chatcmpl-..., resp_..., msg_...)
    jobs: list[Job]
    stream: bool
    answer: Callable[[], Answer]
    priority: int = 0
    images: list[ImageInput] = field(default_factory=list)  # every job's prompt has them


In = TypeVar("In", contravariant=True)


class Codec(Protocol[In]):
    """One wire protocol on one model. `decode` raises CodecError for what the client got
    wrong; it may take a while (rendering, tokenizing, grammar compilation: off the loop)."""

    async def decode(self, request: In) -> Call: ...

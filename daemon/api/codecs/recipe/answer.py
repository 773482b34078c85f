"""Engine outputs -> the recipe's protocol objects: each choice's output parsed by its own
OutputStream; whole, its events accumulated into the response (n>1: the choices merged);
streamed, its events sent as the recipe writes them (n>1: ChunkMerger's rewrite)."""

from __future__ import annotations

import time

from daemon.api.codecs.base import ABORTED, Event
from daemon.api.codecs.recipe.chat_choices import ChunkMerger, merge_responses
from daemon.api.codecs.recipe.codec import CHAT, Accumulator, Protocol
from daemon.api.codecs.recipe.stream import OutputStream
from daemon.api.codecs.recipe.turn import Turn
from daemon.loop.request import RequestOutput


class RecipeAnswer:
    aborted_message = ABORTED
    error_event = "error"

    def __init__(
        self,
        protocol: Protocol,
        rid: str,
        served_name: str,
        outs: list[OutputStream],
        turn: Turn | None = None,
        include_usage: bool = False,
    ) -> None:
        self.protocol, self.rid, self.served_name = protocol, rid, served_name
        self.outs, self.turn = outs, turn
        self.created = int(time.time())
        self.accs: list[Accumulator | None] = [None] * len(outs)
        self.event_name = protocol.response_cls.sse_event_name
        self.merger = ChunkMerger(len(outs), include_usage) if protocol is CHAT else None
        self.done_marker: str | None = protocol.response_cls.sse_done_data()

    def add(self, index: int, out: RequestOutput) -> None:
        stream = self.outs[index]
        events = stream.feed(out)
        acc = self.accs[index]
        if acc is None:
            acc = self.accs[index] = self.protocol.response_cls(
                self.rid,
                self.served_name,
                self.created,
                stream.num_prompt_tokens,
                stream.num_cached_tokens,
            )
        for ev in events:
            acc.accumulate(ev)

    def body(self) -> bytes | str:
        done = [acc for acc in self.accs if acc is not None]
        assert len(done) == len(self.accs)
        body = done[0].to_json() if len(done) == 1 else merge_responses([a.to_json() for a in done])
        return self.turn.finish(body) if self.turn is not None else body

    def opening(self) -> list[Event]:
        return []

    def events(self, index: int, out: RequestOutput) -> list[Event]:
        sent: list[Event] = []
        for ev in self.outs[index].feed(out):
            if self.merger is None:
                data, name = ev.to_json(), self.event_name(ev)
                if self.turn is not None:
                    data = self.turn.event(name, data)
                sent.append((data, name))
            elif (chunk := self.merger.chunk(index, ev.to_json())) is not None:
                sent.append((chunk, None))
        return sent

    def closing(self) -> list[Event]:
        usage = self.merger.usage_chunk() if self.merger is not None else None
        return [(usage, None)] if usage is not None else []

    def close(self) -> None:
        for out in self.outs:
            out.close()

"""Incremental detokenization with stop strings caught across token boundaries.

While streaming, the last len(longest stop)-1 characters are held back: they
could be the start of a stop string that the next token completes.
"""

from __future__ import annotations

from daemon.models.tokenizer import TextTokenizer


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: TextTokenizer | None, stop: list[str], include_stop: bool
    ) -> None:
        self.tokenizer = tokenizer
        self.stream = tokenizer.stream() if tokenizer else None
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.emitted = 0

    def add(self, token_id: int) -> str | None:
        """Append one token; returns the stop string it completed, if any."""
        if self.stream is None:
            return None
        piece = self.stream.step(self.tokenizer.tokenizer, token_id) or ""
        if not piece:
            return None
        old_len = len(self.text)
        self.text += piece
        if not self.stop:
            return None
        search_from = max(0, old_len - self.holdback)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + (len(s) if self.include_stop else 0)]
        return s

    def take(self, final: bool) -> str:
        """Text that is safe to emit now (all of it once `final`)."""
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.holdback)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out

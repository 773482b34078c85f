"""structlog configuration for the daemon: console or JSON lines (JSON by default when stderr
is not a terminal), on stderr or a file that SIGHUP reopens (for logrotate)."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog


class LogSink:
    """A file-like target whose file can be reopened in place."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.stream: TextIO = sys.stderr if path is None else open(path, "a", buffering=1)  # noqa: SIM115

    def write(self, text: str) -> int:
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def reopen(self) -> None:
        if self.path is None:
            return
        old, self.stream = self.stream, open(self.path, "a", buffering=1)  # noqa: SIM115
        old.close()


SINK = LogSink(None)


def setup_logging(level: str = "info", fmt: str = "auto", file: str | None = None) -> LogSink:
    """`fmt`: "console" (readable), "json" (one object a line) or "auto" (JSON unless a TTY)."""
    global SINK
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    old, SINK = SINK, LogSink(file)
    if fmt == "auto":
        fmt = "console" if SINK.isatty() else "json"
    renderer: structlog.typing.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    elif fmt == "console":
        renderer = structlog.dev.ConsoleRenderer(colors=SINK.isatty())
    else:
        raise ValueError(f"unknown log format {fmt!r} (auto, console or json)")
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if fmt == "json":
        processors += [structlog.processors.dict_tracebacks]
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(SINK),
        cache_logger_on_first_use=False,
    )
    # Libraries that log through the standard library (aiohttp, asyncio) go there too.
    logging.basicConfig(
        level=max(numeric, logging.WARNING),
        stream=SINK,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    if old.path is not None:  # a reconfiguration (SIGHUP): the new file took over
        old.stream.close()
    return SINK

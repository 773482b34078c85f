"""structlog configuration for the daemon: console or JSON lines (JSON by default when stderr
is not a terminal), on stderr or a file that SIGHUP reopens (for logrotate). Tracebacks show no
local variables, and secrets (the API key) are masked in every line."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from typing import Any, TextIO

import structlog

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("auto", "console", "json")  # auto: JSON unless the sink is a terminal
MASK = "[redacted]"
_SECRETS: dict[str, None] = {}  # each secret's forms (as is, JSON- and repr-escaped), in order


@dataclass
class LogConfig:
    """The [logging] settings."""

    level: str = "info"  # one of LEVELS
    format: str = "auto"  # one of FORMATS
    file: str | None = None  # append here instead of stderr; reopened on SIGHUP


def add_secret(secret: str | None) -> None:
    """From now on, `secret` shows as MASK in every log line (structlog's and the stdlib's)."""
    if secret:
        for form in (secret, json.dumps(secret)[1:-1], repr(secret)[1:-1]):
            _SECRETS[form] = None


def redact(text: str) -> str:
    for secret in _SECRETS:
        if secret in text:
            text = text.replace(secret, MASK)
    return text


def _redact_line(_logger: Any, _method: str, line: str) -> str:
    return redact(line)


class _RedactingFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


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
        renderer = structlog.dev.ConsoleRenderer(
            colors=SINK.isatty(), exception_formatter=_console_tracebacks()
        )
    else:
        raise ValueError(f"unknown log format {fmt!r} ({', '.join(FORMATS[:-1])} or {FORMATS[-1]})")
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if fmt == "json":
        transformer = structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
        processors += [structlog.processors.ExceptionRenderer(transformer)]
    structlog.configure(
        processors=[*processors, renderer, _redact_line],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(SINK),
        cache_logger_on_first_use=False,
    )
    # Libraries that log through the standard library (aiohttp, asyncio) go there too.
    handler = logging.StreamHandler(SINK)
    handler.setFormatter(_RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=max(numeric, logging.WARNING), handlers=[handler], force=True)
    if old.path is not None:  # a reconfiguration (SIGHUP): the new file took over
        old.stream.close()
    return SINK


def _console_tracebacks() -> structlog.typing.ExceptionRenderer:
    """rich's tracebacks where rich is installed, without the frames' local variables."""
    if structlog.dev.rich is None:
        return structlog.dev.plain_traceback
    return structlog.dev.RichTracebackFormatter(show_locals=False)

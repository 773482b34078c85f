"""Failures that keep the daemon from starting for a reason its operator can fix: reported as
one structured line that names the cause, never as a traceback."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

EXIT_STARTUP_FAILED = 3  # 2: an invalid setting (service.settings.EXIT_INVALID_SETTINGS)


class StartupError(Exception):
    pass


@contextlib.contextmanager
def failing_as(what: str, *errors: type[BaseException]) -> Iterator[None]:
    """Any of `errors` raised inside becomes a StartupError "{what}: {the error}"."""
    try:
        yield
    except errors as e:
        raise StartupError(f"{what}: {_reason(e)}") from e


def _reason(error: BaseException) -> str:
    """An OSError's text without its errno: "Address already in use", "... (path)"."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror + (f" ({error.filename})" if error.filename else "")
    return str(error)

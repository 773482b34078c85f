"""Small real file systems for tests: a tmpfs that fills up, or one mounted read-only."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Path]:
    """Mount a tmpfs at `path` (created) with mount `options`; skips the test where mounting
    is not permitted."""
    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path) -> None:
    """Write a file until the file system is full."""
    with contextlib.suppress(OSError), (path / "filler").open("wb", buffering=0) as f:
        while True:
            f.write(b"\0" * 4096)

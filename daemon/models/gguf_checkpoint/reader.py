"""Finding a .gguf checkpoint and reading its metadata fields."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from gguf import GGUFReader

_MISSING = object()


class GGUFError(ValueError):
    """A GGUF file that cannot be served (the loader reports it as a ModelLoadError)."""


def find_gguf(path: Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one .gguf in a directory that is not
    a Hugging Face checkpoint (no config.json); None where it is not a GGUF checkpoint."""
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        names = ", ".join(f.name for f in files[:4])
        raise GGUFError(f"{path} holds several .gguf files ({names}); pass one of them")
    return files[0] if files else None


@lru_cache(maxsize=2)
def _open(path: Path, mtime_ns: int) -> GGUFReader:
    return GGUFReader(path)


def open_gguf(path: Path) -> GGUFReader:
    """The parsed file (memory-mapped; config, weights and tokenizer share one parse)."""
    try:
        return _open(path.resolve(), path.stat().st_mtime_ns)
    except (ValueError, OSError) as e:  # not GGUF, truncated, unreadable
        raise GGUFError(f"{path.name}: not a readable GGUF file: {e}") from e


def field(reader: GGUFReader, key: str, default: Any = _MISSING) -> Any:
    """A metadata value (scalar, string or array as Python values)."""
    f = reader.get_field(key)
    if f is None:
        if default is _MISSING:
            raise GGUFError(f"GGUF metadata lacks {key!r}")
        return default
    return f.contents()

"""Where deepinfer keeps files between runs (the demo checkpoint, the default block store,
compiled code)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("DEEPINFER_CACHE", Path.home() / ".cache" / "deepinfer"))


def default_store_dir() -> Path:
    """The block store of a daemon told no other (`kv_store_dir = ""` turns it off)."""
    return cache_dir() / "kv-store"


def compile_cache_dir() -> Path:
    """inductor's on-disk caches (TORCHINDUCTOR_CACHE_DIR, where that is not set): a restart
    loads the compiled forward instead of compiling it again."""
    return cache_dir() / "inductor"

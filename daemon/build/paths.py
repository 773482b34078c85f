"""Where deepinfer keeps files between runs (the demo checkpoint, the default block store)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("DEEPINFER_CACHE", Path.home() / ".cache" / "deepinfer"))


def default_store_dir() -> Path:
    """The block store of a daemon told no other (`kv_store_dir = ""` turns it off)."""
    return cache_dir() / "kv-store"

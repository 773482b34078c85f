"""Where deepinfer keeps files between runs (the demo checkpoint, the default block store,
compiled code)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from daemon.build.config import EngineConfig


def cache_dir() -> Path:
    return Path(os.environ.get("DEEPINFER_CACHE", Path.home() / ".cache" / "deepinfer"))


def default_store_dir() -> Path:
    """The block store of a daemon told no other (`kv_store_dir = ""` turns it off)."""
    return cache_dir() / "kv-store"


def compile_cache_dir() -> Path:
    """inductor's on-disk caches (TORCHINDUCTOR_CACHE_DIR, where that is not set): a restart
    loads the compiled forward instead of compiling it again."""
    return cache_dir() / "inductor"


def gguf_cache(cfg: EngineConfig) -> Path | None:
    """Where a GGUF checkpoint's dequantized weights are kept (None: `gguf_weight_cache` is
    off); a restart reads them instead of dequantizing again."""
    return cache_dir() / "weights" if cfg.gguf_weight_cache else None


def use_compile_cache_dir() -> None:
    """Point inductor's caches at `compile_cache_dir()` unless TORCHINDUCTOR_CACHE_DIR names
    another. Importing torch._dynamo sets it to torch's default (under /tmp) if unset, so that
    value counts as unset: otherwise deepinfer's cache would never get inductor's code."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache_dir())

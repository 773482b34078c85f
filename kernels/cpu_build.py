"""Builds the C++ CPU kernels in kernels/csrc once, as one library, through torch's extension
loader, and keeps it under a cache directory (TORCH_EXTENSIONS_DIR, else
$DEEPINFER_CACHE/torch-extensions)."""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import time
from pathlib import Path

import structlog
import torch

log = structlog.get_logger(__name__)

SOURCES = Path(__file__).parent / "csrc"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]


def extensions_dir() -> Path:
    """Where built extensions live: TORCH_EXTENSIONS_DIR if set, else under deepinfer's cache."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env)
    cache = os.environ.get("DEEPINFER_CACHE", str(Path.home() / ".cache" / "deepinfer"))
    return Path(cache) / "torch-extensions"


def headers_digest() -> str:
    """A digest of csrc's headers: torch rebuilds when a source or a flag changes, not a header,
    so the digest rides in the flags."""
    digest = hashlib.sha256()
    for path in sorted(SOURCES.glob("*.h")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def has_avx512() -> bool:
    """Whether this CPU runs the kernels' vector code: torch's AVX512 level (F, BW, VL, DQ),
    which -march=native builds it for."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


_loaded: bool | None = None  # load()'s answer, once it has given one


def available() -> bool:
    """Whether the kernels are loaded, loading them first if nothing tried yet. Traceable by
    torch.compile once loaded (a module flag; load() itself is not)."""
    return load() if _loaded is None else _loaded


@functools.cache
def load() -> bool:
    """Load the operators of csrc/*.cpp into torch (compiled on first use, ~25-35 s on 2 cores:
    each source includes the ATen headers it uses, not <ATen/ATen.h>, ~9 s less; later runs
    load the cached library, which torch rebuilds when a source or the flags change). False,
    with a warning, where they cannot be built (no C++ compiler): callers keep the torch paths."""
    global _loaded
    from torch.utils import cpp_extension

    build = extensions_dir() / "cpu_kernels"
    started = time.perf_counter()
    try:
        build.mkdir(parents=True, exist_ok=True)
        with open(build / "deepinfer.flock", "w") as held:
            # torch's own lock is a file that a build killed midway leaves behind, and every
            # later process then waits on it forever; this lock dies with its process, and
            # whoever holds it knows that a torch lock left there is such a leftover
            fcntl.flock(held, fcntl.LOCK_EX)
            if (build / "lock").exists():
                log.warning("cpu_kernels_stale_lock_removed", path=str(build / "lock"))
                (build / "lock").unlink(missing_ok=True)
            cpp_extension.load(
                name="deepinfer_cpu_kernels",
                sources=[str(p) for p in sorted(SOURCES.glob("*.cpp"))],
                extra_cflags=[*CFLAGS, f"-DDEEPINFER_HEADERS={headers_digest()}"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(build),
                is_python_module=False,
                verbose=False,
            )
    except Exception as e:  # a failed build raises whatever the toolchain gave
        log.warning("cpu_kernels_unavailable", error=f"{type(e).__name__}: {e}"[:500])
        _loaded = False
        return False
    log.info("cpu_kernels_loaded", seconds=round(time.perf_counter() - started, 2))
    _loaded = True
    return True

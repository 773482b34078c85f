"""One OpenMP thread team at a time on a CPU device. Every thread that runs a parallel torch op
keeps a team of worker threads; once libgomp manages more threads than there are cores, it cuts
their spin-wait to ~100 iterations and each parallel op pays a futex wake-up (~40 µs here, ~45 %
of a small model's decode step). So the event loop hands back any team it made, and the device
thread hands back its own while the engine idles."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

OMP_PAUSE_SOFT = 1  # OpenMP 5.0 omp_pause_resource_t: threads go, the runtime stays ready


@functools.cache
def _pause_all() -> Callable[[int], int] | None:
    """`omp_pause_resource_all` of the OpenMP runtime torch loaded (GNU or Intel), if any."""
    import torch  # noqa: F401  (loads the runtime)

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "omp" in line.rsplit("/", 1)[-1]}
    except OSError:
        return None
    for path in sorted(paths):
        if path.rsplit("/", 1)[-1].startswith(("libgomp", "libiomp")):
            pause = getattr(ctypes.CDLL(path), "omp_pause_resource_all", None)
            if pause is not None:
                pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
                return pause
    return None


def release_thread_team() -> bool:
    """Hand back the calling thread's OpenMP worker threads (its next parallel op makes a new
    team); False where the runtime cannot."""
    pause = _pause_all()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0

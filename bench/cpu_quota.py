"""A CPU quota per process (a cgroup of its own, v1 `cpu` or v2 `cpu.max`): daemons on one
small machine then behave as nodes of their own, a node's idle share is not lent to the busy
ones. Needs root and a writable cgroup file system; says so plainly otherwise."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


class QuotaError(RuntimeError):
    """The cgroup cannot be made (not root, no cpu controller, read-only)."""


@dataclass
class CpuQuota:
    """`cpus` cores (0.5: half a core) for whatever joins the group."""

    name: str
    cpus: float

    def __post_init__(self) -> None:
        if self.cpus <= 0:
            raise QuotaError("a CPU quota must be positive")
        quota = max(int(self.cpus * PERIOD_US), 1000)
        try:
            if (V1 / "cpu.cfs_quota_us").exists():
                self.path = V1 / self.name
                self.path.mkdir(exist_ok=True)
                (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (self.path / "cpu.cfs_quota_us").write_text(str(quota))
            elif (V2 / "cgroup.controllers").exists():
                self.path = V2 / self.name
                self.path.mkdir(exist_ok=True)
                (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            else:
                raise QuotaError("no cgroup cpu controller found under /sys/fs/cgroup")
        except OSError as e:
            raise QuotaError(f"cannot set a CPU quota ({e}); run as root, or without it") from e

    def join(self) -> None:
        """Put the calling process in the group (a Popen preexec_fn: before the exec, so every
        thread the program starts is counted)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def throttled_s(self) -> float:
        """Seconds the group waited for its quota so far."""
        text = (self.path / "cpu.stat").read_text()
        stats = dict(line.split() for line in text.splitlines() if line.count(" ") == 1)
        if "throttled_time" in stats:  # v1: ns
            return int(stats["throttled_time"]) / 1e9
        return int(stats.get("throttled_usec", 0)) / 1e6

    def remove(self) -> None:
        """Once its processes have exited."""
        with contextlib.suppress(OSError):  # a process still in it: left to the next boot
            self.path.rmdir()

"""`systemd-analyze verify` accepts the unit files (in a scratch root holding the units
systemd ships and stand-ins for the executables the units run)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parents[1] / "systemd"
SYSTEM_UNITS = Path("/usr/lib/systemd/system")


def _scratch_root(tmp_path: Path, unit: Path) -> Path:
    root = tmp_path / unit.stem
    shutil.copytree(SYSTEM_UNITS, root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    shutil.copy(unit, root / "etc/systemd/system" / unit.name)
    for line in unit.read_text().splitlines():
        if line.startswith("Exec"):
            exe = root / line.split("=", 1)[1].split()[0].lstrip("/")
            exe.parent.mkdir(parents=True, exist_ok=True)
            exe.write_text("#!/bin/sh\n")
            exe.chmod(0o755)
    return root


def test_units_verify(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None or not SYSTEM_UNITS.is_dir():
        pytest.skip("systemd is not installed here (CI installs it)")
    units = sorted(UNITS.glob("*.service"))
    assert units
    for unit in units:
        root = _scratch_root(tmp_path, unit)
        instance = unit.name.replace("@.service", "@prefill0.service")
        done = subprocess.run(
            ["systemd-analyze", "verify", f"--root={root}", instance],
            capture_output=True,
            text=True,
        )
        output = done.stdout + done.stderr
        about_ours = [line for line in output.splitlines() if unit.stem.rstrip("@") in line]
        assert done.returncode == 0 and not about_ours, output

"""What a start imports before the engine is ready: the engine's and the HTTP server's paths
leave xgrammar (and with it transformers, ~3 s) to the grammar thread, after the server is up;
the command line itself (an admin call, a settings check) loads no torch (~2 s)."""

from __future__ import annotations

import sys

from tests.daemons import in_checkout

_IMPORTS = """
import sys
import daemon.build.engine, daemon.loop.runner, daemon.service.cli, daemon.service.generate
import daemon.service.daemon, daemon.api.http.server
print(sorted(m for m in ("transformers", "xgrammar") if m in sys.modules))
"""


def test_the_serving_path_does_not_import_xgrammar_or_transformers() -> None:
    done = in_checkout([sys.executable, "-c", _IMPORTS], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[-2] == "[]"


_CLI = """
import sys
from daemon.service.cli import build_parser
build_parser().parse_args(["admin", "--socket", "/nowhere", "status"])
print(sorted(m for m in ("torch", "transformers", "xgrammar") if m in sys.modules))
"""


def test_the_command_line_does_not_import_torch() -> None:
    done = in_checkout([sys.executable, "-c", _CLI], timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[-2] == "[]"


def test_a_constraint_still_masks_after_its_lazy_import() -> None:
    import torch

    from daemon.loop.constraint import allocate_bitmask, apply_bitmask

    mask = allocate_bitmask(2, 40)
    mask[1] = 0
    mask[1, 0] = 0b100  # row 1 allows token 2 only
    logits = torch.zeros(2, 40)
    apply_bitmask(logits, mask, [1])
    assert torch.isfinite(logits[0]).all()
    assert logits[1, 2] == 0 and torch.isinf(logits[1]).sum() == 39

"""The server freezes its start-up heap: later full collections walk none of it."""

from __future__ import annotations

import sys

from tests.daemons import in_checkout

_PROBE = """
import gc
from daemon.service.heap import freeze_startup_heap
kept = [[i] for i in range(200_000)]  # what start-up built: alive for the whole run
gc.collect()
before = len(gc.get_objects(generation=2))
frozen = freeze_startup_heap()
after = len(gc.get_objects(generation=2))
print(before, frozen, after, all(gc.is_tracked(x) for x in kept[:10]))
"""


def test_a_full_collection_walks_nothing_start_up_built() -> None:
    # its own process: a frozen heap would outlive this test in pytest's
    out = in_checkout([sys.executable, "-c", _PROBE], timeout=120)
    assert out.returncode == 0, out.stderr
    assert "heap_frozen" in out.stdout
    before, frozen, after, tracked = out.stdout.strip().splitlines()[-1].split()
    assert int(before) >= 200_000 and int(frozen) >= 200_000
    assert int(after) < 1_000 and tracked == "True"

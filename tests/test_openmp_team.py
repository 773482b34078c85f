"""The CPU forward's OpenMP team: a thread hands its worker threads back, and the next
parallel op in it makes a new team."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from daemon.loop.openmp import release_thread_team


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def parallel_op() -> None:
    torch.ones(1 << 20).mul_(2.0)  # well above torch's grain size: runs on the whole team


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="a team needs two torch threads")
def test_a_thread_hands_its_team_back_and_gets_a_new_one() -> None:
    seen: dict[str, int] = {}

    def worker() -> None:
        torch.set_num_threads(2)
        seen["before"] = os_threads()
        parallel_op()
        seen["with team"] = os_threads()
        seen["released"] = release_thread_team()
        seen["after"] = os_threads()
        parallel_op()
        seen["again"] = os_threads()
        release_thread_team()

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen["released"] is True
    assert seen["with team"] == seen["before"] + 1  # one worker thread beside this one
    assert seen["after"] == seen["before"]
    assert seen["again"] == seen["with team"]

"""The etcd loops stop for sure: a cancel swallowed once (as 3.11's wait_for can, when the call
completes as the cancel lands) does not leave their stopper waiting for ever."""

from __future__ import annotations

import asyncio

from daemon.cluster.etcd import _bounded, _stopped


async def test_a_task_that_swallows_a_cancel_is_stopped_still() -> None:
    swallowed = 0

    async def beats() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed += 1  # as if the cancel had been lost on the way

    task = asyncio.create_task(beats())
    await asyncio.sleep(0)
    stopping = asyncio.create_task(_stopped(task))
    await asyncio.wait({stopping}, timeout=5)  # a timeout that cancels nothing
    task.cancel()  # (a stopper that waits on still must not hold the test up)
    assert stopping.done() and swallowed == 1 and task.cancelled()


async def test_a_bounded_call_past_its_time_is_a_timeout() -> None:
    started = asyncio.get_running_loop().time()
    try:
        await _bounded(asyncio.sleep(10), 0.05)
    except TimeoutError:
        pass
    else:
        raise AssertionError("no timeout")
    assert asyncio.get_running_loop().time() - started < 5
    assert await _bounded(asyncio.sleep(0, "done"), 1) == "done"

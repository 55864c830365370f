"""aio.wait_event: bounded waits on an event that never lose a cancellation."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from ivy_sandbox.aio import wait_event


async def test_wait_event_says_whether_the_event_came_in_time() -> None:
    event = asyncio.Event()
    assert not await wait_event(event, 0.01)
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_event(event, 5)


async def test_a_cancellation_arriving_as_the_event_is_set_is_not_swallowed() -> None:
    """The race that kept a provisioner loop alive after aclose (asyncio.wait_for, < 3.12)."""
    swallowed = 0
    for _ in range(50):
        event = asyncio.Event()

        async def loop_like_the_claim_loop(event: asyncio.Event = event) -> None:
            while True:
                await wait_event(event, 10)
                event.clear()

        task = asyncio.create_task(loop_like_the_claim_loop())
        await asyncio.sleep(0)  # parked in wait_event
        event.set()  # the wake-up and the cancellation in the same loop iteration
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), 1)
        if not task.done():
            swallowed += 1
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    assert swallowed == 0


@pytest.mark.parametrize("seconds", [0.0, -1.0])
async def test_a_non_positive_wait_returns_at_once(seconds: float) -> None:
    assert not await wait_event(asyncio.Event(), seconds)

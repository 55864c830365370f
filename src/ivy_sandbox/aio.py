"""Small asyncio helpers the event loops of this service share."""

from __future__ import annotations

import asyncio
import contextlib


async def wait_event(event: asyncio.Event, seconds: float) -> bool:
    """``event.wait()`` for at most ``seconds``; True if the event is set.

    Not ``asyncio.wait_for``: before Python 3.12 it can swallow a cancellation that arrives
    just as the awaited event is set (CPython gh-86296). A loop built on it then never stops:
    seen in CI as a test teardown waiting forever for the provisioner's claim loop, which
    went on polling. ``asyncio.timeout`` lets a cancellation from outside through.
    """
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()
    return event.is_set()

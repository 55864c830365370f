"""Watching costs no database connection while nothing changes: an open SSE stream or a
pending long-poll waits on the event bus, and reads (each with its own short connection)
only when woken. So thousands of waiting clients do not exhaust the pool."""

from __future__ import annotations

import asyncio
import contextlib

from conftest import World
from ivy_sandbox.auth.credentials import Credential, CredentialType
from ivy_sandbox.bootstrap import Services
from ivy_sandbox.services import watch


async def still_valid() -> None:
    return None


async def test_idle_sse_streams_and_pending_long_polls_hold_no_database_connection(
    services: Services, world: World
) -> None:
    key = await world.key()
    principal = await services.authenticator.authenticate(Credential(CredentialType.API_KEY, key))
    chats = [await world.chat() for _ in range(5)]
    for chat in chats:
        await world.sandbox(chat, "provisioning", "compute")
    streams = [
        await watch.status_stream(
            services.watching, principal, chat, still_authenticated=still_valid
        )
        for chat in chats
    ]
    for stream in streams:
        assert (await anext(stream)).startswith("retry:")
        assert "event: status" in await anext(stream)  # the current status
    waiting = [asyncio.ensure_future(anext(stream)) for stream in streams]
    waiting += [
        asyncio.ensure_future(
            watch.wait_for_change(
                services.watching,
                principal,
                chat,
                since=None,
                wait_seconds=30,
                still_authenticated=still_valid,
            )
        )
        for chat in chats
    ]
    try:
        await asyncio.sleep(0.2)
        assert not any(task.done() for task in waiting)  # all of them are waiting
        assert services.repository.engine.pool.checkedout() == 0
    finally:
        for task in waiting:
            task.cancel()
        for task in waiting:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]

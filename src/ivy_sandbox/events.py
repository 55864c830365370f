"""Status-change events: "the sandbox of chat X changed", delivered to whoever waits on X.

An event carries only the chat id; a woken waiter reads the status from the database (the
source of truth), so a lost, duplicated or coalesced event can never show a stale or wrong
state — only a late one, which the waiters' periodic re-check bounds.

Two buses behind one small interface:

* :class:`LocalEventBus` — in-process (the embedded default): published after the writing
  transaction commits.
* :class:`PostgresEventBus` — ``NOTIFY`` inside the writing transaction (PostgreSQL delivers
  it only on commit, exactly once per commit) and one ``LISTEN`` connection per process that
  fans notifications out locally. A change made by a worker in another process reaches the
  API process that holds the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection

from ivy_sandbox.aio import wait_event

log = logging.getLogger(__name__)

CHANNEL = "ivy_sandbox_status"


class Subscription:
    """Wakes when the watched chat's sandbox changes. Cheap: one asyncio.Event."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def _set(self) -> None:
        self._event.set()

    async def wait(self, seconds: float) -> bool:
        """True if a change arrived within ``seconds`` (then re-armed for the next one)."""
        if not await wait_event(self._event, seconds):
            return False
        self._event.clear()
        return True


class EventBus(Protocol):
    cross_process: bool

    async def in_transaction(self, conn: AsyncConnection, chat_id: str) -> None:
        """Called inside the transaction that changed the chat's sandbox."""
        ...

    def after_commit(self, chat_id: str) -> None:
        """Called once that transaction has committed."""
        ...

    def subscribe(self, chat_id: str) -> contextlib.AbstractAsyncContextManager[Subscription]: ...

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...


class _Fanout:
    def __init__(self) -> None:
        self._waiters: dict[str, set[Subscription]] = {}

    def deliver(self, chat_id: str) -> None:
        for subscription in self._waiters.get(chat_id, ()):
            subscription._set()

    def deliver_all(self) -> None:
        for subscriptions in self._waiters.values():
            for subscription in subscriptions:
                subscription._set()

    @contextlib.asynccontextmanager
    async def subscribe(self, chat_id: str) -> AsyncIterator[Subscription]:
        subscription = Subscription()
        self._waiters.setdefault(chat_id, set()).add(subscription)
        try:
            yield subscription
        finally:
            waiters = self._waiters.get(chat_id)
            if waiters is not None:
                waiters.discard(subscription)
                if not waiters:
                    del self._waiters[chat_id]


class LocalEventBus:
    """In-process delivery: enough when the API and the worker share one process."""

    cross_process = False

    def __init__(self) -> None:
        self._fanout = _Fanout()

    async def in_transaction(self, conn: AsyncConnection, chat_id: str) -> None:  # noqa: ARG002
        return None

    def after_commit(self, chat_id: str) -> None:
        self._fanout.deliver(chat_id)

    def subscribe(self, chat_id: str) -> contextlib.AbstractAsyncContextManager[Subscription]:
        return self._fanout.subscribe(chat_id)

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None


class PostgresEventBus:
    """LISTEN/NOTIFY: changes committed by any process reach waiters in every process."""

    cross_process = True
    RECONNECT_SECONDS = 1.0
    HEALTH_CHECK_SECONDS = 30.0

    def __init__(self, database_url: str) -> None:
        url = make_url(database_url).set(drivername="postgresql")
        self._dsn = url.render_as_string(hide_password=False)
        self._fanout = _Fanout()
        self._task: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()

    async def in_transaction(self, conn: AsyncConnection, chat_id: str) -> None:
        await conn.execute(
            text("SELECT pg_notify(:channel, :chat)"), {"channel": CHANNEL, "chat": chat_id}
        )

    def after_commit(self, chat_id: str) -> None:  # noqa: ARG002
        return None  # the LISTEN connection delivers it, here and in every other process

    def subscribe(self, chat_id: str) -> contextlib.AbstractAsyncContextManager[Subscription]:
        return self._fanout.subscribe(chat_id)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._listen_forever(), name="ivy-listen")
        await wait_event(self._connected, 5)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _listen_forever(self) -> None:
        import asyncpg

        def on_notify(_conn: Any, _pid: int, _channel: str, payload: str) -> None:
            self._fanout.deliver(payload)

        while True:
            connection = None
            lost = asyncio.Event()
            try:
                connection = await asyncpg.connect(self._dsn, timeout=5)
                connection.add_termination_listener(functools.partial(_set_event, lost))
                await connection.add_listener(CHANNEL, on_notify)
                self._connected.set()
                # Anything may have changed while we were not listening: wake every waiter.
                self._fanout.deliver_all()
                while not lost.is_set():
                    if not await wait_event(lost, self.HEALTH_CHECK_SECONDS):
                        await connection.execute("SELECT 1")  # notice a silently dead link
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning(
                    "status events: LISTEN connection lost (%s); reconnecting", type(exc).__name__
                )
            finally:
                self._connected.clear()
                if connection is not None and not connection.is_closed():
                    with contextlib.suppress(Exception):
                        await connection.close()
            await asyncio.sleep(self.RECONNECT_SECONDS)


def _set_event(event: asyncio.Event, _connection: Any) -> None:
    event.set()


def make_event_bus(database_url: str) -> EventBus:
    if make_url(database_url).get_backend_name() == "postgresql":
        return PostgresEventBus(database_url)
    return LocalEventBus()

"""Engines for the two supported databases, tuned for how this service uses them.

SQLite is the embedded default: WAL so readers never wait for the writer, a busy timeout so
admin commands can write while ``serve`` runs on the same file, and foreign keys on.

Writes on SQLite go through :func:`write_transaction`, which lets one transaction of this
process write at a time. SQLite allows one writer anyway; without the lock, pooled connections
compete for it inside SQLite's busy handler, which *sleeps* with back-off (1, 2, 5 … 100 ms)
instead of queueing. Measured with 20 concurrent launches: write transactions averaged
50-100 ms and peaked over a second, and launches spent ~0.5 s waiting to be admitted. With
the lock they wait their turn on an asyncio queue. Reads never take it (WAL).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy import Engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import AsyncAdaptedQueuePool

SQLITE_BUSY_TIMEOUT_MS = 10_000


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def sqlite_path(url: str) -> str | None:
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or not parsed.database:
        return None
    return None if parsed.database == ":memory:" else parsed.database


def _tune_sqlite(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


_WRITE_LOCKS: weakref.WeakKeyDictionary[Engine, asyncio.Lock] = weakref.WeakKeyDictionary()


@asynccontextmanager
async def write_transaction(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """``engine.begin()`` for a transaction that writes (see the module docstring)."""
    if engine.dialect.name != "sqlite":
        async with engine.begin() as conn:
            yield conn
        return
    lock = _WRITE_LOCKS.get(engine.sync_engine)
    if lock is None:
        lock = _WRITE_LOCKS[engine.sync_engine] = asyncio.Lock()
    async with lock, engine.begin() as conn:
        yield conn


def create_engine(url: str) -> AsyncEngine:
    """Create the async engine for ``url`` (sqlite+aiosqlite or postgresql+asyncpg)."""
    if is_sqlite(url):
        engine = create_async_engine(
            url,
            poolclass=AsyncAdaptedQueuePool,
            pool_size=4,
            max_overflow=4,
            connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
        )
        event.listen(engine.sync_engine, "connect", _tune_sqlite)
        return engine
    return create_async_engine(
        url,
        pool_size=10,
        max_overflow=10,
        pool_pre_ping=True,
        pool_timeout=5,
        connect_args={"timeout": 5, "command_timeout": 10},
    )

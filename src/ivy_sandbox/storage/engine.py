"""Engines for the two supported databases, tuned for how this service uses them.

SQLite is the embedded default: WAL so readers never wait for the writer, a busy timeout so
admin commands can write while ``serve`` runs on the same file, and foreign keys on.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
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

"""Run the Alembic migrations from code (no alembic.ini needed), safe against concurrent runs.

``serve``, ``worker`` and admin commands all call :func:`migrate`; the first one to get the
lock upgrades, the others find the schema at head. SQLite uses a file lock beside the
database; PostgreSQL a transaction-scoped advisory lock.
"""

from __future__ import annotations

import asyncio
import fcntl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from ivy_sandbox.storage.engine import sqlite_path

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
PG_MIGRATION_LOCK = 0x1A7_5A4D  # arbitrary, stable advisory-lock key


def alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


@asynccontextmanager
async def _file_lock(path: str | None) -> AsyncIterator[None]:
    """Serialise migrations of one SQLite file across processes (and tasks of this one).

    ``flock`` blocks, so it is taken in a thread: a second migrate() in the same event loop
    then waits without stalling the loop the first one needs to finish.
    """
    if path is None:
        yield
        return
    with open(f"{path}.migrate.lock", "w") as handle:  # noqa: ASYNC230 - a local lock file
        await asyncio.to_thread(fcntl.flock, handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _upgrade(connection: Connection, revision: str) -> None:
    if connection.dialect.name == "postgresql":
        connection.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": PG_MIGRATION_LOCK})
    config = alembic_config()
    config.attributes["connection"] = connection
    command.upgrade(config, revision)


async def migrate(engine: AsyncEngine, revision: str = "head") -> None:
    """Upgrade the database behind ``engine`` to ``revision``."""
    async with _file_lock(sqlite_path(str(engine.url))), engine.begin() as connection:
        await connection.run_sync(_upgrade, revision)


def head_revision() -> str:
    """The newest revision the code knows (what ``migrate`` upgrades to)."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head

"""Storage on real databases (SQLite always; PostgreSQL with IVY_TEST_POSTGRES_URL).

Schema = migrations (Alembic autogenerate finds no difference), migrations are idempotent and
safe to run concurrently, times are aware UTC, and the repository's queries hold their
promises (one access decision, last-used at most once a minute, idempotent user creation,
first revocation time kept).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Column, Integer, MetaData, Table, func, insert, inspect, select
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.exc import StatementError
from sqlalchemy.ext.asyncio import AsyncEngine

from conftest import POSTGRES_URL, World, service_unavailable
from fakes import FakeClock
from ivy_sandbox.domain.sandbox import Phase, SandboxStatus
from ivy_sandbox.errors import NotFound
from ivy_sandbox.storage.engine import create_engine
from ivy_sandbox.storage.migrate import head_revision, migrate
from ivy_sandbox.storage.repository import ChatAccess, Repository
from ivy_sandbox.storage.tables import metadata, users

PLUS_TWO = timezone(timedelta(hours=2))


# -- helpers -----------------------------------------------------------------------------------
def _schema_diff(connection: Connection, target: MetaData) -> list[Any]:
    context = MigrationContext.configure(connection, opts={"compare_type": True})
    diff: list[Any] = compare_metadata(context, target)
    return diff


async def schema_diff(engine: AsyncEngine, target: MetaData = metadata) -> list[Any]:
    async with engine.connect() as conn:
        return await conn.run_sync(_schema_diff, target)


async def table_names(engine: AsyncEngine) -> set[str]:
    async with engine.connect() as conn:
        return set(await conn.run_sync(lambda sync: inspect(sync).get_table_names()))


async def current_revision(engine: AsyncEngine) -> str | None:
    async with engine.connect() as conn:
        return await conn.run_sync(
            lambda sync: MigrationContext.configure(sync).get_current_revision()
        )


async def assert_at_head_with_exact_schema(engine: AsyncEngine) -> None:
    assert await current_revision(engine) == head_revision()
    assert await table_names(engine) == set(metadata.tables) | {"alembic_version"}
    assert await schema_diff(engine) == []


async def kid_of_only_key(repository: Repository, user_id: str = "user_alice") -> str:
    (record,) = await repository.list_api_keys(user_id)
    return record.id


# -- schema and migrations ---------------------------------------------------------------------
async def test_migrations_create_exactly_the_tables_in_metadata(repository: Repository) -> None:
    await assert_at_head_with_exact_schema(repository.engine)


async def test_schema_comparison_would_notice_a_table_or_column_the_migrations_lack(
    repository: Repository,
) -> None:
    drifted = MetaData()
    for table in metadata.tables.values():
        table.to_metadata(drifted)
    Table("extra", drifted, Column("id", Integer, primary_key=True))
    drifted.tables["users"].append_column(Column("nickname", Integer, nullable=True))
    kinds = {entry[0] for entry in await schema_diff(repository.engine, drifted)}
    assert {"add_table", "add_column"} <= kinds


async def test_migrate_again_is_a_no_op(repository: Repository) -> None:
    await migrate(repository.engine)
    await migrate(repository.engine)
    await assert_at_head_with_exact_schema(repository.engine)


MIGRATE_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    from ivy_sandbox.storage.engine import create_engine
    from ivy_sandbox.storage.migrate import migrate

    async def main(url: str, calls: int) -> None:
        engines = [create_engine(url) for _ in range(calls)]
        await asyncio.gather(*(migrate(engine) for engine in engines))
        for engine in engines:
            await engine.dispose()

    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
    """
)


def run_migrate_processes(url: str, processes: int, calls_each: int, timeout: float) -> None:
    """Start ``processes`` Python processes, each making ``calls_each`` concurrent migrate()s."""
    started = [
        subprocess.Popen(
            [sys.executable, "-c", MIGRATE_SCRIPT, url, str(calls_each)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(processes)
    ]
    errors = []
    for process in started:
        try:
            _, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            errors.append(f"migrate() did not finish within {timeout} s (deadlock?)")
            continue
        if process.returncode != 0:
            errors.append(err.strip().splitlines()[-1] if err.strip() else "exit status != 0")
    assert not errors, errors


async def test_concurrent_migrate_from_four_processes_on_a_new_sqlite_file(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'fresh.db'}"
    await asyncio.to_thread(run_migrate_processes, url, 4, 1, 30)
    engine = create_engine(url)
    try:
        await assert_at_head_with_exact_schema(engine)
    finally:
        await engine.dispose()


async def test_four_concurrent_migrate_calls_in_one_event_loop_on_a_new_sqlite_file(
    tmp_path: Path,
) -> None:
    # In a child process: a deadlocked event loop (a blocking file lock taken inside it, as
    # once happened) cannot be cancelled from inside, so only a timeout outside can catch it.
    url = f"sqlite+aiosqlite:///{tmp_path / 'fresh.db'}"
    await asyncio.to_thread(run_migrate_processes, url, 1, 4, 20)
    engine = create_engine(url)
    try:
        await assert_at_head_with_exact_schema(engine)
    finally:
        await engine.dispose()


@pytest.fixture
async def fresh_postgres_url() -> AsyncIterator[str]:
    """A brand-new, empty PostgreSQL database, dropped afterwards."""
    if not POSTGRES_URL:
        service_unavailable("IVY_TEST_POSTGRES_URL is not set (no PostgreSQL for this run)")
    import asyncpg

    admin_url = make_url(POSTGRES_URL).set(drivername="postgresql")
    name = f"ivy_test_migrate_{uuid.uuid4().hex[:12]}"

    async def admin(sql: str) -> None:
        conn = await asyncpg.connect(admin_url.render_as_string(hide_password=False))
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    await admin(f'CREATE DATABASE "{name}"')
    try:
        yield (
            admin_url.set(drivername="postgresql+asyncpg", database=name).render_as_string(
                hide_password=False
            )
        )
    finally:
        await admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.postgres
async def test_four_concurrent_migrate_calls_on_a_new_postgres_database(
    fresh_postgres_url: str,
) -> None:
    engines = [create_engine(fresh_postgres_url) for _ in range(4)]
    try:
        await asyncio.wait_for(asyncio.gather(*(migrate(e) for e in engines)), timeout=30)
        await assert_at_head_with_exact_schema(engines[0])
        await migrate(engines[1])
        await assert_at_head_with_exact_schema(engines[1])
    finally:
        for engine in engines:
            await engine.dispose()


# -- UTCDateTime -------------------------------------------------------------------------------
async def test_aware_datetimes_round_trip_as_the_same_instant_in_utc(
    repository: Repository,
) -> None:
    written = datetime(2026, 11, 29, 11, 30, 15, 123456, tzinfo=PLUS_TWO)
    async with repository.engine.begin() as conn:
        await conn.execute(insert(users).values(id="user_tz", created_at=written))
    async with repository.engine.connect() as conn:
        read = (await conn.execute(select(users.c.created_at))).scalar_one()
    assert read == written
    assert read.utcoffset() == timedelta(0)
    assert read.tzinfo is not None
    assert read.replace(tzinfo=None) == datetime(2026, 11, 29, 9, 30, 15, 123456)


async def test_times_are_stored_as_utc_so_sql_comparisons_agree(repository: Repository) -> None:
    """SQLite keeps no zone: values must be normalised to UTC before they are written."""
    early_in_utc = datetime(2026, 1, 1, 10, 0, tzinfo=PLUS_TWO)  # 08:00 UTC
    later_in_utc = datetime(2026, 1, 1, 9, 0, tzinfo=UTC)  # 09:00 UTC
    async with repository.engine.begin() as conn:
        await conn.execute(insert(users).values(id="user_early", created_at=early_in_utc))
        await conn.execute(insert(users).values(id="user_later", created_at=later_in_utc))
    async with repository.engine.connect() as conn:
        ordered = (await conn.execute(select(users.c.id).order_by(users.c.created_at))).all()
        before = (
            await conn.execute(
                select(users.c.id).where(
                    users.c.created_at < datetime(2026, 1, 1, 8, 30, tzinfo=UTC)
                )
            )
        ).all()
    assert [row.id for row in ordered] == ["user_early", "user_later"]
    assert [row.id for row in before] == ["user_early"]


async def test_naive_datetimes_are_rejected_not_stored(repository: Repository) -> None:
    with pytest.raises(StatementError) as info:
        async with repository.engine.begin() as conn:
            await conn.execute(
                insert(users).values(id="user_naive", created_at=datetime(2026, 1, 1))
            )
    assert isinstance(info.value.orig, ValueError)
    assert not await repository.user_exists("user_naive")


# -- chat_access: one query, one answer --------------------------------------------------------
async def test_chat_access_is_none_for_missing_foreign_and_out_of_scope_chats(
    repository: Repository, world: World
) -> None:
    project_a = await world.project(name="a")
    project_b = await world.project(name="b")
    in_a = await world.chat(project_id=project_a)
    in_b = await world.chat(project_id=project_b)
    no_project = await world.chat()
    bobs = await world.chat("user_bob")

    assert await repository.chat_access("chat_missing", "user_alice", None) is None
    assert await repository.chat_access(bobs, "user_alice", None) is None
    assert await repository.chat_access(in_a, "user_bob", None) is None
    assert await repository.chat_access(in_b, "user_alice", project_a) is None
    assert await repository.chat_access(no_project, "user_alice", project_a) is None
    assert await repository.chat_access(in_a, "user_alice", "proj_missing") is None

    assert await repository.chat_access(in_a, "user_alice", project_a) == ChatAccess(sandbox=None)
    for chat in (in_a, in_b, no_project):  # an unscoped principal sees all of its chats
        assert await repository.chat_access(chat, "user_alice", None) == ChatAccess(sandbox=None)


async def test_chat_access_returns_the_sandbox_snapshot(
    repository: Repository, world: World, clock: FakeClock
) -> None:
    chat = await world.chat()
    created = clock.now()
    await world.sandbox(
        chat,
        "provisioning",
        "mount",
        eta_seconds=9,
        created_at=created - timedelta(seconds=5),
        phase_started_at=created,
    )
    access = await repository.chat_access(chat, "user_alice", None)
    assert access is not None
    snapshot = access.sandbox
    assert snapshot is not None
    assert snapshot.status is SandboxStatus("provisioning")
    assert snapshot.phase is Phase("mount")
    assert snapshot.eta_seconds == 9
    assert snapshot.error_message is None
    assert snapshot.created_at == created - timedelta(seconds=5)
    assert snapshot.phase_started_at == created
    assert snapshot.created_at.utcoffset() == timedelta(0)


async def test_chat_access_carries_the_error_message_of_a_failed_sandbox(
    repository: Repository, world: World
) -> None:
    project = await world.project()
    chat = await world.chat(project_id=project)
    await world.sandbox(chat, "failed", "failed", error_code="boom", error_message="It broke")
    access = await repository.chat_access(chat, "user_alice", project)
    assert access is not None
    assert access.sandbox is not None
    assert (access.sandbox.status, access.sandbox.phase) == (
        SandboxStatus("failed"),
        Phase("failed"),
    )
    assert access.sandbox.error_message == "It broke"
    assert await repository.chat_access(chat, "user_bob", None) is None


# -- API keys ----------------------------------------------------------------------------------
async def test_touch_api_key_writes_last_used_at_most_once_a_minute(
    repository: Repository, world: World, clock: FakeClock
) -> None:
    await world.key()
    kid = await kid_of_only_key(repository)
    t = clock.now()

    async def last_used_after_touch(at: datetime) -> datetime | None:
        await repository.touch_api_key(kid, at)
        record = await repository.api_key(kid)
        assert record is not None
        return record.last_used_at

    never_used = await repository.api_key(kid)
    assert never_used is not None
    assert never_used.last_used_at is None
    assert await last_used_after_touch(t) == t
    assert await last_used_after_touch(t + timedelta(seconds=30)) == t
    assert await last_used_after_touch(t + timedelta(seconds=60)) == t
    assert await last_used_after_touch(t + timedelta(seconds=61)) == t + timedelta(seconds=61)
    assert await last_used_after_touch(t + timedelta(seconds=90)) == t + timedelta(seconds=61)


async def test_touch_api_key_of_an_unknown_key_is_harmless(
    repository: Repository, clock: FakeClock
) -> None:
    await repository.touch_api_key("key_unknown", clock.now())
    assert await repository.api_key("key_unknown") is None


async def test_revoke_api_key_keeps_the_first_revocation_time(
    repository: Repository, world: World, clock: FakeClock
) -> None:
    await world.key()
    await world.key("user_bob")
    kid = await kid_of_only_key(repository)
    t = clock.now()
    await repository.revoke_api_key(kid, t)
    await repository.revoke_api_key(kid, t + timedelta(hours=1))
    record = await repository.api_key(kid)
    assert record is not None
    assert record.revoked_at == t
    bobs = await repository.api_key(await kid_of_only_key(repository, "user_bob"))
    assert bobs is not None
    assert bobs.revoked_at is None


async def test_revoke_unknown_api_key_raises_not_found(
    repository: Repository, clock: FakeClock
) -> None:
    with pytest.raises(NotFound):
        await repository.revoke_api_key("key_unknown", clock.now())


# -- users -------------------------------------------------------------------------------------
async def test_ensure_user_is_idempotent_under_concurrency(
    repository: Repository, database_url: str, clock: FakeClock
) -> None:
    first = clock.now()
    engines = [create_engine(database_url) for _ in range(3)]  # like separate processes
    try:
        calls = [
            Repository(engine).ensure_user("user_new", first + timedelta(seconds=i))
            for i in range(4)
            for engine in engines
        ]
        await asyncio.gather(*calls)
    finally:
        for engine in engines:
            await engine.dispose()
    await repository.ensure_user("user_new", first + timedelta(days=1))
    async with repository.engine.connect() as conn:
        rows = (await conn.execute(select(users).where(users.c.id == "user_new"))).all()
    assert len(rows) == 1
    assert first <= rows[0].created_at < first + timedelta(seconds=4)


async def test_ensure_user_keeps_an_existing_user(
    repository: Repository, world: World, clock: FakeClock
) -> None:
    await world.user("user_alice")
    await repository.ensure_user("user_alice", clock.now() + timedelta(days=3))
    async with repository.engine.connect() as conn:
        count = (await conn.execute(select(func.count()).select_from(users))).scalar_one()
        created = (await conn.execute(select(users.c.created_at))).scalar_one()
    assert count == 1
    assert created == clock.now()

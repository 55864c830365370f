"""The repository: every query the service makes, behind one small class.

Services depend on these methods, never on SQL. Each method is one short transaction.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Row, Table, and_, insert, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.sql.elements import ColumnElement

from ivy_sandbox.domain.sandbox import Phase, SandboxSnapshot, SandboxStatus
from ivy_sandbox.errors import Conflict, NotFound
from ivy_sandbox.storage.engine import sqlite_path, write_transaction
from ivy_sandbox.storage.sqlite_reads import NO_CHAT, SqliteStatusReader
from ivy_sandbox.storage.tables import api_keys, chats, projects, sandboxes, users

LAST_USED_RESOLUTION = timedelta(minutes=1)


@dataclass(frozen=True, slots=True)
class PageKey:
    """Where a page starts: just after the row with this (created_at, id)."""

    created_at: datetime
    id: str


@dataclass(frozen=True, slots=True)
class ChatAccess:
    """The answer to "may this principal see this chat, and what is its sandbox?"."""

    sandbox: SandboxSnapshot | None


@dataclass(frozen=True, slots=True)
class ApiKeyRecord:
    id: str
    user_id: str
    project_id: str | None
    name: str | None
    secret_hash: bytes
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    last_used_at: datetime | None


@dataclass(frozen=True, slots=True)
class ProjectRecord:
    id: str
    user_id: str
    name: str
    created_at: datetime


@dataclass(frozen=True, slots=True)
class ChatRecord:
    id: str
    user_id: str
    project_id: str | None
    title: str | None
    created_at: datetime


_ACCESS_QUERY = select(
    chats.c.id,
    sandboxes.c.status,
    sandboxes.c.phase,
    sandboxes.c.created_at,
    sandboxes.c.phase_started_at,
    sandboxes.c.eta_seconds,
    sandboxes.c.error_message,
).select_from(chats.outerjoin(sandboxes, sandboxes.c.chat_id == chats.c.id))


class Repository:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        path = sqlite_path(str(engine.url))
        # SQLite: the hot read runs on the loop's thread (see sqlite_reads for why).
        self._fast = SqliteStatusReader(path) if path and os.path.exists(path) else None

    async def dispose(self) -> None:
        """Close the SQLite fast reader (if any) and the engine's pool."""
        if self._fast is not None:
            self._fast.close()
            self._fast = None
        await self.engine.dispose()

    async def ping(self) -> None:
        """One round trip to the database (readiness)."""
        async with self.engine.connect() as conn:
            await conn.execute(select(1))

    # -- the hot path ------------------------------------------------------------------
    async def chat_access(
        self, chat_id: str, user_id: str, project_id: str | None
    ) -> ChatAccess | None:
        """One query: the chat exists AND is the user's AND is inside the project scope.

        ``None`` when any condition fails; the caller cannot tell which (no oracle).
        """
        if self._fast is not None:
            found = self._fast.chat_sandbox(chat_id, user_id, project_id)
            if found is NO_CHAT:
                return None
            assert found is None or isinstance(found, SandboxSnapshot)
            return ChatAccess(sandbox=found)
        condition = and_(chats.c.id == chat_id, chats.c.user_id == user_id)
        if project_id is not None:
            condition = and_(condition, chats.c.project_id == project_id)
        async with self.engine.connect() as conn:
            row = (await conn.execute(_ACCESS_QUERY.where(condition))).first()
        if row is None:
            return None
        if row.status is None:
            return ChatAccess(sandbox=None)
        return ChatAccess(
            sandbox=SandboxSnapshot(
                status=SandboxStatus(row.status),
                phase=Phase(row.phase),
                created_at=row.created_at,
                phase_started_at=row.phase_started_at,
                eta_seconds=row.eta_seconds,
                error_message=row.error_message,
            )
        )

    async def api_key(self, kid: str) -> ApiKeyRecord | None:
        if self._fast is not None:
            values = self._fast.api_key_row(kid)
            return None if values is None else ApiKeyRecord(**values)
        async with self.engine.connect() as conn:
            row = (await conn.execute(select(api_keys).where(api_keys.c.id == kid))).first()
        return None if row is None else ApiKeyRecord(**row._mapping)

    async def touch_api_key(self, kid: str, now: datetime) -> None:
        """Record use, at most once a minute per key (the WHERE makes it cheap and idempotent)."""
        stale = now - LAST_USED_RESOLUTION
        async with write_transaction(self.engine) as conn:
            await conn.execute(
                update(api_keys)
                .where(
                    api_keys.c.id == kid,
                    or_(api_keys.c.last_used_at.is_(None), api_keys.c.last_used_at < stale),
                )
                .values(last_used_at=now)
            )

    # -- users, projects, chats, keys --------------------------------------------------
    async def ensure_user(self, user_id: str, now: datetime) -> None:
        """Create the user if absent (first valid session token); concurrent calls are fine."""
        async with write_transaction(self.engine) as conn:
            stmt: Any
            if conn.dialect.name == "postgresql":
                stmt = pg_insert(users).on_conflict_do_nothing(index_elements=["id"])
            else:
                stmt = sqlite_insert(users).on_conflict_do_nothing(index_elements=["id"])
            await conn.execute(stmt.values(id=user_id, created_at=now))

    async def create_user(self, user_id: str, now: datetime) -> None:
        try:
            async with write_transaction(self.engine) as conn:
                await conn.execute(insert(users).values(id=user_id, created_at=now))
        except IntegrityError:
            raise Conflict(
                f"user {user_id} exists", detail=f"User {user_id} already exists."
            ) from None

    async def user_exists(self, user_id: str) -> bool:
        async with self.engine.connect() as conn:
            row = (await conn.execute(select(users.c.id).where(users.c.id == user_id))).first()
        return row is not None

    async def create_project(self, project: ProjectRecord) -> None:
        async with write_transaction(self.engine) as conn:
            await conn.execute(insert(projects).values(**_fields(project)))

    async def project(self, project_id: str) -> ProjectRecord | None:
        async with self.engine.connect() as conn:
            row = (await conn.execute(select(projects).where(projects.c.id == project_id))).first()
        return None if row is None else ProjectRecord(**row._mapping)

    async def create_chat(self, chat: ChatRecord) -> None:
        async with write_transaction(self.engine) as conn:
            await conn.execute(insert(chats).values(**_fields(chat)))

    async def create_api_key(self, key: ApiKeyRecord) -> None:
        async with write_transaction(self.engine) as conn:
            await conn.execute(insert(api_keys).values(**_fields(key)))

    async def list_api_keys(self, user_id: str) -> list[ApiKeyRecord]:
        query = (
            select(api_keys)
            .where(api_keys.c.user_id == user_id)
            .order_by(api_keys.c.created_at, api_keys.c.id)
        )
        async with self.engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        return [ApiKeyRecord(**row._mapping) for row in rows]

    async def revoke_api_key(self, kid: str, now: datetime) -> None:
        """Revoke a key; revoking twice keeps the first revocation time."""
        async with write_transaction(self.engine) as conn:
            found = (await conn.execute(select(api_keys.c.id).where(api_keys.c.id == kid))).first()
            if found is None:
                raise NotFound(f"api key {kid} not found", detail=f"No API key {kid}.")
            await conn.execute(
                update(api_keys)
                .where(api_keys.c.id == kid, api_keys.c.revoked_at.is_(None))
                .values(revoked_at=now)
            )

    # -- what a user owns, as the user-facing API sees it (pages keyed by created_at, id) ---
    async def owned_project(self, project_id: str, user_id: str) -> ProjectRecord | None:
        """The project when it exists AND is the user's; ``None`` for either failure."""
        query = select(projects).where(projects.c.id == project_id, projects.c.user_id == user_id)
        async with self.engine.connect() as conn:
            row = (await conn.execute(query)).first()
        return None if row is None else ProjectRecord(**row._mapping)

    async def owned_chat(
        self, chat_id: str, user_id: str, project_id: str | None
    ) -> ChatRecord | None:
        """The chat, with :meth:`chat_access`'s AND semantics: exists, is the user's and is
        inside the project scope — one query, ``None`` for any failure (no oracle)."""
        condition = and_(chats.c.id == chat_id, chats.c.user_id == user_id)
        if project_id is not None:
            condition = and_(condition, chats.c.project_id == project_id)
        async with self.engine.connect() as conn:
            row = (await conn.execute(select(chats).where(condition))).first()
        return None if row is None else ChatRecord(**row._mapping)

    async def projects_page(
        self,
        user_id: str,
        *,
        only_project: str | None,
        after: PageKey | None,
        limit: int,
    ) -> list[ProjectRecord]:
        """Up to ``limit`` of the user's projects after ``after`` (``only_project``: just it)."""
        condition = projects.c.user_id == user_id
        if only_project is not None:
            condition = and_(condition, projects.c.id == only_project)
        rows = await self._page(projects, condition, after, limit)
        return [ProjectRecord(**row._mapping) for row in rows]

    async def chats_page(
        self, user_id: str, *, project_id: str | None, after: PageKey | None, limit: int
    ) -> list[ChatRecord]:
        """Up to ``limit`` of the user's chats (in ``project_id`` when given) after ``after``."""
        condition = chats.c.user_id == user_id
        if project_id is not None:
            condition = and_(condition, chats.c.project_id == project_id)
        rows = await self._page(chats, condition, after, limit)
        return [ChatRecord(**row._mapping) for row in rows]

    async def api_keys_page(
        self, user_id: str, *, after: PageKey | None, limit: int
    ) -> list[ApiKeyRecord]:
        rows = await self._page(api_keys, api_keys.c.user_id == user_id, after, limit)
        return [ApiKeyRecord(**row._mapping) for row in rows]

    async def revoke_owned_api_key(self, kid: str, user_id: str, now: datetime) -> bool:
        """Revoke the user's key (the first revocation time is kept). ``False`` when the key
        does not exist or is another user's — the two are not told apart."""
        async with write_transaction(self.engine) as conn:
            found = (
                await conn.execute(
                    select(api_keys.c.id).where(api_keys.c.id == kid, api_keys.c.user_id == user_id)
                )
            ).first()
            if found is None:
                return False
            await conn.execute(
                update(api_keys)
                .where(api_keys.c.id == kid, api_keys.c.revoked_at.is_(None))
                .values(revoked_at=now)
            )
        return True

    async def _page(
        self, table: Table, condition: ColumnElement[bool], after: PageKey | None, limit: int
    ) -> Sequence[Row[Any]]:
        """Keyset pagination on (created_at, id): stable under inserts, no OFFSET scans."""
        if after is not None:
            condition = and_(
                condition,
                or_(
                    table.c.created_at > after.created_at,
                    and_(table.c.created_at == after.created_at, table.c.id > after.id),
                ),
            )
        query = select(table).where(condition).order_by(table.c.created_at, table.c.id)
        async with self.engine.connect() as conn:
            return (await conn.execute(query.limit(limit))).all()


def _fields(record: Any) -> dict[str, Any]:
    return {name: getattr(record, name) for name in record.__slots__}

"""Sandbox rows: the lifecycle's source of truth, and every query the engine makes on them.

Writes by a worker are *fenced*: they name the sandbox id, the expected status and the lease
owner, and report whether a row changed. A worker that gets ``False`` has lost the sandbox
(stopped by a user, relaunched, or taken over after its lease expired) and must let go.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, delete, func, insert, or_, select, text, type_coerce, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ivy_sandbox.domain.eta import PhaseStat
from ivy_sandbox.domain.sandbox import Phase, SandboxSnapshot, SandboxStatus, rfc3339
from ivy_sandbox.events import EventBus, LocalEventBus
from ivy_sandbox.storage.engine import write_transaction
from ivy_sandbox.storage.phase_stats import fold_phase_duration, read_phase_stats
from ivy_sandbox.storage.tables import UTCDateTime, sandboxes

PG_ADMISSION_LOCK = 0x1A7_AD01


@dataclass(frozen=True, slots=True)
class SandboxRecord:
    id: str
    chat_id: str
    status: SandboxStatus
    phase: Phase
    error_code: str | None
    error_message: str | None
    eta_seconds: float | None
    created_at: datetime
    phase_started_at: datetime
    ready_at: datetime | None
    last_activity_at: datetime | None
    updated_at: datetime
    backend: str
    backend_state: dict[str, Any]
    lease_owner: str | None
    lease_expires_at: datetime | None
    admitted_at: datetime | None
    timeline: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_row(cls, row: Any) -> SandboxRecord:
        values = dict(row._mapping)
        values["status"] = SandboxStatus(values["status"])
        values["phase"] = Phase(values["phase"])
        values["backend_state"] = values["backend_state"] or {}
        values["timeline"] = list(values["timeline"] or [])
        return cls(**values)

    def snapshot(self) -> SandboxSnapshot:
        return SandboxSnapshot(
            status=self.status,
            phase=self.phase,
            created_at=self.created_at,
            phase_started_at=self.phase_started_at,
            eta_seconds=self.eta_seconds,
            error_message=self.error_message,
        )


@dataclass(frozen=True, slots=True)
class ActiveSandbox:
    """What the liveness sweep reads of an active sandbox (see ``active_pages``)."""

    id: str
    chat_id: str
    backend_state: dict[str, Any]
    last_activity_at: datetime  # the last exec or keepalive, else ready, else created


def next_timeline(
    timeline: Sequence[dict[str, Any]], now: datetime, phase: Phase | None
) -> list[dict[str, Any]]:
    """Close the open entry at ``now`` and, if ``phase`` is given, open one for it."""
    entries = [dict(entry) for entry in timeline]
    stamp = rfc3339(now)
    if entries and entries[-1].get("endedAt") is None:
        entries[-1]["endedAt"] = stamp
    if phase is not None:
        entries.append({"phase": phase.value, "startedAt": stamp, "endedAt": None})
    return entries


class SandboxRepository:
    """Every write that changes what a status reader sees publishes the chat on ``bus``."""

    def __init__(self, engine: AsyncEngine, bus: EventBus | None = None) -> None:
        self.engine = engine
        self.bus: EventBus = bus if bus is not None else LocalEventBus()

    # -- reads ---------------------------------------------------------------------------
    async def by_chat(self, chat_id: str) -> SandboxRecord | None:
        async with self.engine.connect() as conn:
            return await self._by_chat(conn, chat_id)

    async def by_id(self, sandbox_id: str) -> SandboxRecord | None:
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(select(sandboxes).where(sandboxes.c.id == sandbox_id))
            ).first()
        return None if row is None else SandboxRecord.from_row(row)

    async def with_status(self, *statuses: SandboxStatus) -> list[SandboxRecord]:
        query = select(sandboxes).where(sandboxes.c.status.in_([s.value for s in statuses]))
        async with self.engine.connect() as conn:
            rows = (await conn.execute(query.order_by(sandboxes.c.created_at))).all()
        return [SandboxRecord.from_row(row) for row in rows]

    async def ids_with_status(self, *statuses: SandboxStatus) -> set[str]:
        """Just the ids (the orphan sweep's question: which sandboxes have a live record?).
        Whole records of 500 sandboxes took ~36 ms to parse in one slice of the loop."""
        query = select(sandboxes.c.id).where(sandboxes.c.status.in_([s.value for s in statuses]))
        async with self.engine.connect() as conn:
            return set((await conn.execute(query)).scalars())

    async def active_pages(self, page_size: int = 50) -> AsyncIterator[list[ActiveSandbox]]:
        """Every active sandbox, a page at a time (keyset by id), as the liveness sweep needs
        it. The sweep runs once a second over hundreds of sandboxes: it must not parse them
        all in one slice of the loop, nor parse what it does not read (the timeline, five
        timestamps: a page of 50 full records took ~3.5 ms of the loop, ~1 ms this way)."""
        last_activity = type_coerce(
            func.coalesce(
                sandboxes.c.last_activity_at, sandboxes.c.ready_at, sandboxes.c.created_at
            ),
            UTCDateTime(),
        )
        columns = (sandboxes.c.id, sandboxes.c.chat_id, sandboxes.c.backend_state, last_activity)
        after = ""
        while True:
            query = (
                select(*columns)
                .where(sandboxes.c.status == SandboxStatus.ACTIVE.value, sandboxes.c.id > after)
                .order_by(sandboxes.c.id)
                .limit(page_size)
            )
            async with self.engine.connect() as conn:
                rows = (await conn.execute(query)).all()
            if not rows:
                return
            yield [ActiveSandbox(row[0], row[1], row[2] or {}, row[3]) for row in rows]
            if len(rows) < page_size:
                return
            after = rows[-1][0]

    async def count_by_status(self) -> dict[SandboxStatus, int]:
        query = select(sandboxes.c.status, func.count()).group_by(sandboxes.c.status)
        async with self.engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        return {SandboxStatus(status): int(count) for status, count in rows}

    async def claimable(self, now: datetime, limit: int) -> list[str]:
        """Provisioning sandboxes that no live worker holds, oldest first."""
        query = (
            select(sandboxes.c.id)
            .where(
                sandboxes.c.status == SandboxStatus.PROVISIONING.value,
                or_(sandboxes.c.lease_expires_at.is_(None), sandboxes.c.lease_expires_at < now),
            )
            .order_by(sandboxes.c.created_at, sandboxes.c.id)
            .limit(limit)
        )
        async with self.engine.connect() as conn:
            return list((await conn.execute(query)).scalars())

    async def leases_held(self) -> dict[str, str]:
        """sandbox id → lease owner, for provisioning sandboxes with a lease."""
        query = select(sandboxes.c.id, sandboxes.c.lease_owner).where(
            sandboxes.c.status == SandboxStatus.PROVISIONING.value,
            sandboxes.c.lease_owner.is_not(None),
        )
        async with self.engine.connect() as conn:
            return {row.id: row.lease_owner for row in (await conn.execute(query))}

    async def queue_position(self, record: SandboxRecord) -> int | None:
        """1 for the next launch to get capacity; None when admitted or not provisioning."""
        if record.admitted_at is not None or record.status is not SandboxStatus.PROVISIONING:
            return None
        query = select(func.count()).where(
            sandboxes.c.status == SandboxStatus.PROVISIONING.value,
            sandboxes.c.admitted_at.is_(None),
            or_(
                sandboxes.c.created_at < record.created_at,
                and_(sandboxes.c.created_at == record.created_at, sandboxes.c.id < record.id),
            ),
        )
        async with self.engine.connect() as conn:
            ahead = (await conn.execute(query)).scalar_one()
        return int(ahead) + 1

    async def phase_stats(self, backend: str) -> dict[Phase, PhaseStat]:
        async with self.engine.connect() as conn:
            return await read_phase_stats(conn, backend)

    # -- launch / stop (API side) --------------------------------------------------------
    async def launch(self, record: SandboxRecord) -> tuple[SandboxRecord, bool]:
        """Insert ``record`` unless the chat already has a live sandbox.

        Returns the chat's current sandbox and whether it is the new one. A failed sandbox
        is replaced; a provisioning or active one is returned unchanged (idempotent launch).
        Concurrent launches for one chat resolve through the unique chat_id.
        """
        for _ in range(3):
            try:
                async with write_transaction(self.engine) as conn:
                    current = await self._by_chat(conn, record.chat_id)
                    if current is not None and current.status is not SandboxStatus.FAILED:
                        return current, False
                    if current is not None:
                        await conn.execute(delete(sandboxes).where(sandboxes.c.id == current.id))
                    await conn.execute(insert(sandboxes).values(**_values(record)))
                    await self.bus.in_transaction(conn, record.chat_id)
                self.bus.after_commit(record.chat_id)
                return record, True
            except IntegrityError:
                continue  # another launch for the chat won the race: read what it made
        current = await self.by_chat(record.chat_id)
        if current is None:
            raise RuntimeError("launch kept conflicting without a winner")
        return current, False

    async def remove(self, chat_id: str) -> SandboxRecord | None:
        """Delete the chat's sandbox row (stop); returns what was there for cleanup."""
        async with write_transaction(self.engine) as conn:
            current = await self._by_chat(conn, chat_id)
            if current is not None:
                await conn.execute(delete(sandboxes).where(sandboxes.c.id == current.id))
                await self.bus.in_transaction(conn, chat_id)
        if current is not None:
            self.bus.after_commit(chat_id)
        return current

    async def remove_by_id(self, record: ActiveSandbox, status: SandboxStatus) -> bool:
        async with write_transaction(self.engine) as conn:
            result = await conn.execute(
                delete(sandboxes).where(
                    sandboxes.c.id == record.id, sandboxes.c.status == status.value
                )
            )
            removed = result.rowcount == 1
            if removed:
                await self.bus.in_transaction(conn, record.chat_id)
        if removed:
            self.bus.after_commit(record.chat_id)
        return removed

    async def touch_activity(self, sandbox_id: str, now: datetime) -> None:
        async with write_transaction(self.engine) as conn:
            await conn.execute(
                update(sandboxes).where(sandboxes.c.id == sandbox_id).values(last_activity_at=now)
            )

    # -- engine writes (fenced) ----------------------------------------------------------
    async def claim(self, sandbox_id: str, owner: str, now: datetime, ttl: timedelta) -> bool:
        async with write_transaction(self.engine) as conn:
            result = await conn.execute(
                update(sandboxes)
                .where(
                    sandboxes.c.id == sandbox_id,
                    sandboxes.c.status == SandboxStatus.PROVISIONING.value,
                    or_(
                        sandboxes.c.lease_expires_at.is_(None),
                        sandboxes.c.lease_expires_at < now,
                        sandboxes.c.lease_owner == owner,
                    ),
                )
                .values(lease_owner=owner, lease_expires_at=now + ttl)
            )
        return result.rowcount == 1

    async def renew(self, sandbox_id: str, owner: str, now: datetime, ttl: timedelta) -> bool:
        return await self._fenced(sandbox_id, owner, lease_expires_at=now + ttl)

    async def release(self, sandbox_id: str, owner: str) -> None:
        async with write_transaction(self.engine) as conn:
            await conn.execute(
                update(sandboxes)
                .where(sandboxes.c.id == sandbox_id, sandboxes.c.lease_owner == owner)
                .values(lease_owner=None, lease_expires_at=None)
            )

    async def release_leases(self, owners: Sequence[str]) -> int:
        """Free leases held by workers known to be dead, so their launches resume at once."""
        if not owners:
            return 0
        async with write_transaction(self.engine) as conn:
            result = await conn.execute(
                update(sandboxes)
                .where(sandboxes.c.lease_owner.in_(list(owners)))
                .values(lease_owner=None, lease_expires_at=None)
            )
        return int(result.rowcount)

    async def mark_queued(self, record: SandboxRecord, owner: str, now: datetime) -> bool:
        """Waiting for capacity: the ETA is unknown until a slot frees."""
        return await self._fenced(
            record.id, owner, notify=record.chat_id, eta_seconds=None, updated_at=now
        )

    async def admit(
        self,
        record: SandboxRecord,
        owner: str,
        now: datetime,
        capacity: int,
        eta_seconds: float | None,
    ) -> bool:
        """Give the sandbox a slot if there is one free for it *and* for every older launch
        still waiting (FIFO: a younger launch never takes a slot an older one needs).

        Counting the older waiters, rather than requiring that there be none, matters when
        many launches arrive together below capacity: each is admitted on its first try,
        instead of one per round of wake-ups (measured: 20 simultaneous launches spent
        ~750 ms queueing for slots that were free all along).

        The compute phase's clock restarts at admission, so queue time does not pollute the
        phase statistics and the ETA counts from when work really began.
        """
        holders = sandboxes.alias("holders")
        waiting = sandboxes.alias("waiting")
        used = (
            select(func.count())
            .select_from(holders)
            .where(
                holders.c.admitted_at.is_not(None),
                holders.c.status.in_(["provisioning", "active"]),
            )
            .scalar_subquery()
        )
        older_waiting = (
            select(func.count())
            .select_from(waiting)
            .where(
                waiting.c.status == SandboxStatus.PROVISIONING.value,
                waiting.c.admitted_at.is_(None),
                or_(
                    waiting.c.created_at < record.created_at,
                    and_(waiting.c.created_at == record.created_at, waiting.c.id < record.id),
                ),
            )
            .scalar_subquery()
        )
        async with write_transaction(self.engine) as conn:
            if conn.dialect.name == "postgresql":
                await conn.execute(
                    text("SELECT pg_advisory_xact_lock(:k)"), {"k": PG_ADMISSION_LOCK}
                )
            result = await conn.execute(
                update(sandboxes)
                .where(
                    sandboxes.c.id == record.id,
                    sandboxes.c.lease_owner == owner,
                    sandboxes.c.admitted_at.is_(None),
                    used + older_waiting < capacity,
                )
                .values(admitted_at=now, phase_started_at=now, eta_seconds=eta_seconds)
            )
            admitted = result.rowcount == 1
            if admitted:
                await self.bus.in_transaction(conn, record.chat_id)
        if admitted:
            self.bus.after_commit(record.chat_id)
        return admitted

    async def enter_phase(
        self,
        record: SandboxRecord,
        owner: str,
        phase: Phase,
        now: datetime,
        eta_seconds: float | None,
        status: SandboxStatus = SandboxStatus.PROVISIONING,
    ) -> bool:
        moved = _moved(record, phase, now, eta_seconds, status)
        values = _move_values(moved)
        return await self._fenced(record.id, owner, notify=record.chat_id, **values)

    async def transition(
        self,
        record: SandboxRecord,
        owner: str,
        *,
        phase: Phase,
        now: datetime,
        eta_seconds: float | None,
        backend: str,
        finished_seconds: float,
        status: SandboxStatus = SandboxStatus.PROVISIONING,
        backend_state: dict[str, Any] | None = None,
    ) -> tuple[SandboxRecord | None, PhaseStat]:
        """One transaction: fold the finished phase's duration into ``backend``'s statistic,
        then the fenced move to ``phase`` (saving ``backend_state`` too, if given).

        Returns the sandbox as it now is — or None if it moved on — and the new statistic."""
        moved = _moved(record, phase, now, eta_seconds, status)
        if backend_state is not None:
            moved = replace(moved, backend_state=backend_state)
        values = {
            k: v for k, v in _values(moved).items() if getattr(record, k) != getattr(moved, k)
        }
        for attempt in range(3):
            try:
                async with write_transaction(self.engine) as conn:
                    stat = await fold_phase_duration(
                        conn, backend, record.phase, finished_seconds, now
                    )
                    changed = await self._fenced_in(conn, record.id, owner, values)
                    if changed:
                        await self.bus.in_transaction(conn, record.chat_id)
                break
            except IntegrityError:
                if attempt == 2:
                    raise
        if not changed:
            return None, stat
        self.bus.after_commit(record.chat_id)
        return moved, stat

    async def fail(
        self,
        sandbox_id: str,
        code: str,
        message: str,
        now: datetime,
        *,
        owner: str | None = None,
        from_status: SandboxStatus = SandboxStatus.PROVISIONING,
    ) -> SandboxRecord | None:
        """Mark the sandbox failed; returns the record as it was, or None if it moved on."""
        async with write_transaction(self.engine) as conn:
            row = (
                await conn.execute(select(sandboxes).where(sandboxes.c.id == sandbox_id))
            ).first()
            if row is None:
                return None
            record = SandboxRecord.from_row(row)
            conditions = [sandboxes.c.id == sandbox_id, sandboxes.c.status == from_status.value]
            if owner is not None:
                conditions.append(sandboxes.c.lease_owner == owner)
            result = await conn.execute(
                update(sandboxes)
                .where(*conditions)
                .values(
                    status=SandboxStatus.FAILED.value,
                    phase=Phase.FAILED.value,
                    error_code=code,
                    error_message=message,
                    eta_seconds=None,
                    phase_started_at=now,
                    updated_at=now,
                    lease_owner=None,
                    lease_expires_at=None,
                    timeline=next_timeline(record.timeline, now, None),
                )
            )
            failed = result.rowcount == 1
            if failed:
                await self.bus.in_transaction(conn, record.chat_id)
        if not failed:
            return None
        self.bus.after_commit(record.chat_id)
        return record

    # -- helpers -------------------------------------------------------------------------
    async def _fenced(
        self, sandbox_id: str, owner: str, *, notify: str | None = None, **values: Any
    ) -> bool:
        async with write_transaction(self.engine) as conn:
            changed = await self._fenced_in(conn, sandbox_id, owner, values)
            if changed and notify is not None:
                await self.bus.in_transaction(conn, notify)
        if changed and notify is not None:
            self.bus.after_commit(notify)
        return changed

    @staticmethod
    async def _fenced_in(
        conn: AsyncConnection, sandbox_id: str, owner: str, values: dict[str, Any]
    ) -> bool:
        result = await conn.execute(
            update(sandboxes)
            .where(
                sandboxes.c.id == sandbox_id,
                sandboxes.c.status == SandboxStatus.PROVISIONING.value,
                sandboxes.c.lease_owner == owner,
            )
            .values(**values)
        )
        return bool(result.rowcount == 1)

    @staticmethod
    async def _by_chat(conn: AsyncConnection, chat_id: str) -> SandboxRecord | None:
        row = (await conn.execute(select(sandboxes).where(sandboxes.c.chat_id == chat_id))).first()
        return None if row is None else SandboxRecord.from_row(row)


def _moved(
    record: SandboxRecord,
    phase: Phase,
    now: datetime,
    eta_seconds: float | None,
    status: SandboxStatus,
) -> SandboxRecord:
    """``record`` moved to ``phase`` (and ``status``) at ``now``."""
    active = status is SandboxStatus.ACTIVE
    moved = replace(
        record,
        phase=phase,
        status=status,
        phase_started_at=now,
        updated_at=now,
        eta_seconds=eta_seconds,
        timeline=next_timeline(record.timeline, now, None if active else phase),
    )
    if active:
        moved = replace(
            moved, ready_at=now, last_activity_at=now, lease_owner=None, lease_expires_at=None
        )
    return moved


_MOVE_COLUMNS = ("phase", "status", "phase_started_at", "updated_at", "eta_seconds", "timeline")
_ACTIVE_COLUMNS = ("ready_at", "last_activity_at", "lease_owner", "lease_expires_at")


def _move_values(moved: SandboxRecord, *, with_state: bool = False) -> dict[str, Any]:
    """The columns a phase move writes — and nothing else: a fenced write must not put back
    stale values of other columns (the lease renewer writes ``lease_expires_at`` meanwhile)."""
    columns: tuple[str, ...] = _MOVE_COLUMNS
    if moved.status is SandboxStatus.ACTIVE:
        columns += _ACTIVE_COLUMNS
    if with_state:
        columns += ("backend_state",)
    values = _values(moved)
    return {column: values[column] for column in columns}


def _values(record: SandboxRecord) -> dict[str, Any]:
    values = {name: getattr(record, name) for name in record.__slots__}
    values["status"] = record.status.value
    values["phase"] = record.phase.value
    return values

"""Per-backend, per-phase launch statistics (what the ETA is estimated from).

Folded inside the caller's transaction, so a phase's duration and the sandbox's move to the
next phase commit together: whoever sees the new phase also sees the statistic, and a launch
pays one write transaction per phase instead of two.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from ivy_sandbox.domain.eta import PhaseStat, observe
from ivy_sandbox.domain.sandbox import Phase
from ivy_sandbox.storage.tables import phase_stats


async def read_phase_stats(conn: AsyncConnection, backend: str) -> dict[Phase, PhaseStat]:
    query = select(phase_stats).where(phase_stats.c.backend == backend)
    rows = (await conn.execute(query)).all()
    return {Phase(r.phase): PhaseStat(r.samples, r.mean_seconds) for r in rows}


async def fold_phase_duration(
    conn: AsyncConnection, backend: str, phase: Phase, seconds: float, now: datetime
) -> PhaseStat:
    """Fold one observed duration into the statistic, atomically: concurrent launches must not
    overwrite each other's samples (PostgreSQL: row lock; SQLite: one writer at a time).

    A concurrent *first* sample can make the insert fail with IntegrityError; the caller
    retries its transaction, which then finds the row."""
    key = (phase_stats.c.backend == backend, phase_stats.c.phase == phase.value)
    query = select(phase_stats.c.samples, phase_stats.c.mean_seconds).where(*key)
    if conn.dialect.name == "postgresql":
        query = query.with_for_update()
    row = (await conn.execute(query)).first()
    current = None if row is None else PhaseStat(row.samples, row.mean_seconds)
    stat = observe(backend, phase, current, seconds)
    values = {"samples": stat.samples, "mean_seconds": stat.mean_seconds, "updated_at": now}
    if row is None:
        await conn.execute(insert(phase_stats).values(backend=backend, phase=phase.value, **values))
    else:
        await conn.execute(update(phase_stats).where(*key).values(**values))
    return stat

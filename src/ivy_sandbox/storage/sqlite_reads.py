"""The status read on SQLite, on the event loop's own thread.

Measured (bench/status_poll.py, py-spy): through aiosqlite every query costs several thread
round-trips, and the status endpoint spent most of its time waiting on them. This reader
runs the one authorization query — the same AND of chat id, owner and project scope — on a
plain ``sqlite3`` connection in the calling thread: a few microseconds, no hop.

Why blocking here is acceptable: the database is a local WAL file, readers never wait for
the writer, and the query is a primary-key lookup. ``busy_timeout`` is kept short so that
the rare wait (a WAL recovery after a crash) cannot stall the loop for long; it then
raises, which the API maps to 503 like any database outage. Each query is its own read
transaction, so it sees every committed change (no stale status).
"""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime
from typing import Any

from ivy_sandbox.domain.sandbox import Phase, SandboxSnapshot, SandboxStatus

_SQL = (
    "SELECT s.status, s.phase, s.created_at, s.phase_started_at, s.eta_seconds,"
    " s.error_message"
    " FROM chats AS c LEFT OUTER JOIN sandboxes AS s ON s.chat_id = c.id"
    " WHERE c.id = ? AND c.user_id = ?"
)
_SCOPED_SQL = _SQL + " AND c.project_id = ?"
_KEY_COLUMNS = (
    "id",
    "user_id",
    "project_id",
    "name",
    "secret_hash",
    "created_at",
    "expires_at",
    "revoked_at",
    "last_used_at",
)
_KEY_TIMES = ("created_at", "expires_at", "revoked_at", "last_used_at")
# The key cache refills every 5 s per key: on the same cheap path as the status read.
_KEY_SQL = f"SELECT {', '.join(_KEY_COLUMNS)} FROM api_keys WHERE id = ?"  # noqa: S608 - constants
BUSY_TIMEOUT_MS = 200

NO_CHAT = object()  # the chat is not visible to this principal
MAX_MEMOISED_ROWS = 4096


def _utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def _snapshot(row: tuple[Any, ...]) -> SandboxSnapshot:
    status, phase, created_at, phase_started_at, eta_seconds, error_message = row
    return SandboxSnapshot(
        status=SandboxStatus(status),
        phase=Phase(phase),
        created_at=_utc(created_at),
        phase_started_at=_utc(phase_started_at),
        eta_seconds=eta_seconds,
        error_message=error_message,
    )


class SqliteStatusReader:
    def __init__(self, path: str) -> None:
        self._connection = sqlite3.connect(
            f"file:{path}?mode=ro", uri=True, check_same_thread=False, isolation_level=None
        )
        self._connection.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        self._connection.execute("PRAGMA query_only=1")
        self._snapshots: dict[tuple[Any, ...], SandboxSnapshot] = {}

    def chat_sandbox(
        self, chat_id: str, user_id: str, project_id: str | None
    ) -> SandboxSnapshot | object | None:
        """The chat's sandbox snapshot, None for a visible chat without one, or NO_CHAT."""
        if project_id is None:
            row = self._connection.execute(_SQL, (chat_id, user_id)).fetchone()
        else:
            row = self._connection.execute(_SCOPED_SQL, (chat_id, user_id, project_id)).fetchone()
        if row is None:
            return NO_CHAT
        if row[0] is None:
            return None
        # The row is read every time (no stale status); only its parsing is memoised: a
        # polled sandbox's row stays the same for seconds to hours.
        snapshot = self._snapshots.get(row)
        if snapshot is None:
            if len(self._snapshots) >= MAX_MEMOISED_ROWS:
                self._snapshots.clear()
            snapshot = self._snapshots[row] = _snapshot(row)
        return snapshot

    def api_key_row(self, kid: str) -> dict[str, Any] | None:
        """The api_keys row of ``kid`` as column → value (times as aware UTC), or None."""
        cursor = self._connection.execute(_KEY_SQL, (kid,))
        row = cursor.fetchone()
        if row is None:
            return None
        values = dict(zip(_KEY_COLUMNS, row, strict=True))
        for column in _KEY_TIMES:
            if values[column] is not None:
                values[column] = _utc(values[column])
        return values

    def close(self) -> None:
        self._connection.close()

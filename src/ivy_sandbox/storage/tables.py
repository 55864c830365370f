"""The schema, as SQLAlchemy Core tables. Alembic migrations must keep it in step.

Times are stored as timezone-aware UTC (``UTCDateTime``): SQLite keeps no zone, so values are
normalised to UTC on the way in and marked UTC on the way out.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Column,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
)
from sqlalchemy.types import TypeDecorator

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)


class UTCDateTime(TypeDecorator[datetime]):
    """A datetime that is always timezone-aware UTC in Python, whatever the database keeps."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetimes are not stored; use an aware UTC datetime")
        value = value.astimezone(UTC)
        if dialect.name == "sqlite":
            return value.replace(tzinfo=None)
        return value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:  # noqa: ARG002
        if value is None:
            return None
        assert isinstance(value, datetime)
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


ID = 64  # longest id we generate or accept

users = Table(
    "users",
    metadata,
    Column("id", String(ID), primary_key=True),
    Column("created_at", UTCDateTime(), nullable=False),
)

projects = Table(
    "projects",
    metadata,
    Column("id", String(ID), primary_key=True),
    Column("user_id", String(ID), ForeignKey("users.id", ondelete="CASCADE"), nullable=False),
    Column("name", String(200), nullable=False),
    Column("created_at", UTCDateTime(), nullable=False),
    Index(None, "user_id", "created_at", "id"),  # the owner's listing, in page order
)

chats = Table(
    "chats",
    metadata,
    Column("id", String(ID), primary_key=True),
    Column("user_id", String(ID), ForeignKey("users.id", ondelete="CASCADE"), nullable=False),
    Column("project_id", String(ID), ForeignKey("projects.id", ondelete="SET NULL"), nullable=True),
    Column("title", String(500), nullable=True),
    Column("created_at", UTCDateTime(), nullable=False),
    Index(None, "user_id", "created_at", "id"),
    Index(None, "project_id"),
)

api_keys = Table(
    "api_keys",
    metadata,
    Column("id", String(ID), primary_key=True),  # the key's public kid
    Column("user_id", String(ID), ForeignKey("users.id", ondelete="CASCADE"), nullable=False),
    Column("project_id", String(ID), ForeignKey("projects.id", ondelete="CASCADE"), nullable=True),
    Column("name", String(200), nullable=True),
    Column("secret_hash", LargeBinary(32), nullable=False),  # HMAC-SHA256(pepper, key)
    Column("created_at", UTCDateTime(), nullable=False),
    Column("expires_at", UTCDateTime(), nullable=True),
    Column("revoked_at", UTCDateTime(), nullable=True),
    Column("last_used_at", UTCDateTime(), nullable=True),
    Index(None, "user_id", "created_at", "id"),
)

# At most one sandbox per chat (the current one); "none" is the absence of a row.
sandboxes = Table(
    "sandboxes",
    metadata,
    Column("id", String(ID), primary_key=True),
    Column(
        "chat_id",
        String(ID),
        ForeignKey("chats.id", ondelete="CASCADE"),
        nullable=False,
        unique=True,
    ),
    Column("status", String(16), nullable=False),  # provisioning | active | failed
    Column("phase", String(16), nullable=False),  # compute | mount | ready | failed
    Column("error_code", String(64), nullable=True),
    Column("error_message", Text(), nullable=True),
    # Estimated seconds until ready, as of phase_started_at (NULL: unknown, e.g. queued).
    Column("eta_seconds", Float(), nullable=True),
    Column("created_at", UTCDateTime(), nullable=False),
    Column("phase_started_at", UTCDateTime(), nullable=False),
    Column("ready_at", UTCDateTime(), nullable=True),
    Column("last_activity_at", UTCDateTime(), nullable=True),
    Column("updated_at", UTCDateTime(), nullable=False),
    Column("backend", String(64), nullable=False),
    Column("backend_state", JSON(), nullable=False, default=dict),
    Column("lease_owner", String(128), nullable=True),
    Column("lease_expires_at", UTCDateTime(), nullable=True),
    # Set when the sandbox got one of the IVY_MAX_SANDBOXES slots; NULL while queued.
    Column("admitted_at", UTCDateTime(), nullable=True),
    # [{"phase": "compute", "startedAt": "...", "endedAt": "..." | null}, ...]
    Column("timeline", JSON(), nullable=False, default=list),
    Index(None, "status"),
)

# Rolling per-phase launch statistics per backend, for the ETA (survive restarts).
phase_stats = Table(
    "phase_stats",
    metadata,
    Column("backend", String(64), primary_key=True),
    Column("phase", String(16), primary_key=True),
    Column("samples", Integer(), nullable=False),
    Column("mean_seconds", Float(), nullable=False),
    Column("updated_at", UTCDateTime(), nullable=False),
)

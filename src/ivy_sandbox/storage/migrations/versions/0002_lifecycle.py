"""Lifecycle: admission time and phase timeline on sandboxes; per-phase launch statistics.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 10:20:00

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("sandboxes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("admitted_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(
            sa.Column("timeline", sa.JSON(), nullable=False, server_default=sa.text("'[]'"))
        )
    op.create_table(
        "phase_stats",
        sa.Column("backend", sa.String(length=64), nullable=False),
        sa.Column("phase", sa.String(length=16), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("mean_seconds", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("backend", "phase", name=op.f("pk_phase_stats")),
    )


def downgrade() -> None:
    op.drop_table("phase_stats")
    with op.batch_alter_table("sandboxes", schema=None) as batch_op:
        batch_op.drop_column("timeline")
        batch_op.drop_column("admitted_at")

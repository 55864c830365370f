"""Listing indexes: (user_id, created_at, id) for the paginated lists of projects, chats, keys.

They replace the single-column user_id indexes, which they cover.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29 11:05:00

"""

from collections.abc import Sequence

from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("projects", "chats", "api_keys")


def upgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_index(batch_op.f(f"ix_{table}_user_id"))
            batch_op.create_index(
                batch_op.f(f"ix_{table}_user_id_created_at_id"),
                ["user_id", "created_at", "id"],
                unique=False,
            )


def downgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_index(batch_op.f(f"ix_{table}_user_id_created_at_id"))
            batch_op.create_index(batch_op.f(f"ix_{table}_user_id"), ["user_id"], unique=False)

"""Alembic environment: always driven from code with a connection in ``config.attributes``."""

from alembic import context

from ivy_sandbox.storage.tables import metadata

connection = context.config.attributes.get("connection")
if connection is None:  # pragma: no cover - only reachable through the plain alembic CLI
    raise SystemExit("run migrations with `ivy-sandbox migrate`")

context.configure(
    connection=connection,
    target_metadata=metadata,
    render_as_batch=connection.dialect.name == "sqlite",
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()

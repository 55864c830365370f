"""Server-side commands: serve, migrate, worker."""

from __future__ import annotations

import gc
from typing import Annotated

import typer

from ivy_sandbox.cli.common import run_or_fail, run_with_repository, settings_or_exit
from ivy_sandbox.logs import configure_logging
from ivy_sandbox.services.clock import SystemClock
from ivy_sandbox.storage.repository import Repository


def freeze_startup_heap() -> None:
    """Move every object alive now (the imported modules, the app) out of the collector's sight.

    A full (generation 2) collection walks every tracked object: with the ~130k objects the
    imports alone create, it blocked the loop for 80-92 ms each time enough long-lived objects
    had piled up (every 10-30 s while 500 sandboxes ran: the density benchmark's status p99).
    Frozen, the same collections took 8-20 ms. Those objects live as long as the process.
    """
    gc.collect()  # the import-time garbage goes first, so it is not frozen forever
    gc.freeze()


def register(app: typer.Typer) -> None:
    app.command()(serve)
    app.command()(migrate)
    app.command()(worker)


def serve(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
) -> None:
    """Run the API server (migrates the database first)."""
    import uvicorn

    from ivy_sandbox.api.app import create_app
    from ivy_sandbox.bootstrap import preflight

    settings = settings_or_exit()
    run_or_fail(preflight(settings))
    configure_logging(settings.log_format, settings.log_level)
    app = create_app(settings)
    freeze_startup_heap()
    # log_config=None: uvicorn's loggers go through our handler (JSON, with request ids).
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_config=None,
        access_log=settings.access_log,
        log_level=settings.log_level.lower(),
    )


def migrate() -> None:
    """Upgrade the database schema to the latest revision; prints the revision."""
    from ivy_sandbox.storage.migrate import head_revision

    settings = settings_or_exit()

    async def noop(_: Repository) -> None:
        return None

    run_with_repository(settings, noop)
    typer.echo(head_revision())


def worker() -> None:
    """Drive launches, watch sandboxes and reconcile, without serving HTTP.

    Run any number beside `serve` (with IVY_RUN_WORKER=false there, or not) on the same
    database; leases make sure one worker drives each launch.
    """
    from ivy_sandbox.bootstrap import engine_settings, make_backend, open_repository
    from ivy_sandbox.events import make_event_bus
    from ivy_sandbox.storage.sandboxes import SandboxRepository
    from ivy_sandbox.workers.provisioner import Provisioner

    settings = settings_or_exit()
    configure_logging(settings.log_format, settings.log_level)

    async def main() -> None:
        repository = await open_repository(settings)
        backend = make_backend(settings)
        # Publishing needs no listener: on PostgreSQL, NOTIFY rides on each committed change.
        bus = make_event_bus(settings.effective_database_url)
        provisioner = Provisioner(
            SandboxRepository(repository.engine, bus),
            backend,
            SystemClock(),
            engine_settings(settings),
        )
        try:
            await provisioner.run_forever()
        finally:
            await backend.aclose()
            await repository.dispose()

    freeze_startup_heap()
    run_or_fail(main())

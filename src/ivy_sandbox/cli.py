"""The ``ivy-sandbox`` command line.

Scriptable by contract: a command prints only its value on stdout (an id, a key, one line per
listed item) unless ``--json`` is given; errors are one line on stderr with a non-zero exit
(1 for a refused request, 2 for bad configuration or usage).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Awaitable, Callable, Coroutine
from datetime import timedelta
from typing import Annotated, Any, NoReturn, TypeVar

import typer

from ivy_sandbox.config import Settings, api_key_pepper, load_settings
from ivy_sandbox.domain.sandbox import rfc3339
from ivy_sandbox.errors import ApiError, ConfigurationError
from ivy_sandbox.services import accounts
from ivy_sandbox.services.clock import SystemClock
from ivy_sandbox.storage.repository import ApiKeyRecord, Repository

T = TypeVar("T")

app = typer.Typer(
    name="ivy-sandbox",
    help="Run and administer an ivy-sandbox server.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
admin = typer.Typer(help="Manage users, projects, chats and API keys (direct database access).")
users_app = typer.Typer(help="Users.", no_args_is_help=True)
projects_app = typer.Typer(help="Projects.", no_args_is_help=True)
chats_app = typer.Typer(help="Chats.", no_args_is_help=True)
keys_app = typer.Typer(help="API keys.", no_args_is_help=True)
admin.add_typer(users_app, name="users")
admin.add_typer(projects_app, name="projects")
admin.add_typer(chats_app, name="chats")
admin.add_typer(keys_app, name="keys")
app.add_typer(admin, name="admin", no_args_is_help=True)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


def fail(message: str, code: int = 1) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def settings_or_exit() -> Settings:
    try:
        return load_settings()
    except ConfigurationError as exc:
        fail(str(exc), 2)


def run_with_repository(settings: Settings, use_case: Callable[[Repository], Awaitable[T]]) -> T:
    """Open the database (migrating if needed), run one use case, close, map errors to a line."""
    from ivy_sandbox.bootstrap import open_repository

    async def main() -> T:
        repository = await open_repository(settings)
        try:
            return await use_case(repository)
        finally:
            await repository.engine.dispose()

    return run_or_fail(main())


def run_or_fail(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine``; turn every expected failure into one line on stderr."""
    try:
        return asyncio.run(coroutine)
    except ApiError as exc:
        fail(exc.detail)
    except ConfigurationError as exc:
        fail(str(exc), 2)
    except OSError as exc:
        fail(f"cannot reach the database: {exc.strerror or exc}")
    except Exception as exc:
        if type(exc).__module__.startswith("sqlalchemy"):
            fail(f"database error: {type(exc).__name__}: {getattr(exc, 'orig', exc)}")
        raise


def emit(value: str, as_json: bool, payload: dict[str, Any] | list[Any]) -> None:
    typer.echo(json.dumps(payload) if as_json else value)


@app.command()
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
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    uvicorn.run(create_app(settings), host=host, port=port, log_level="info")


@app.command()
def migrate() -> None:
    """Upgrade the database schema to the latest revision; prints the revision."""
    from ivy_sandbox.storage.migrate import head_revision

    settings = settings_or_exit()

    async def noop(_: Repository) -> None:
        return None

    run_with_repository(settings, noop)
    typer.echo(head_revision())


@users_app.command("create")
def users_create(
    user_id: Annotated[str, typer.Argument(metavar="USER_ID")], as_json: JsonFlag = False
) -> None:
    """Create a user; prints USER_ID."""
    settings = settings_or_exit()
    clock = SystemClock()
    run_with_repository(settings, lambda r: accounts.create_user(r, clock, user_id))
    emit(user_id, as_json, {"id": user_id})


@projects_app.command("create")
def projects_create(
    name: Annotated[str, typer.Argument(metavar="NAME")],
    user: Annotated[str, typer.Option("--user", metavar="USER_ID", help="Owner.")],
    as_json: JsonFlag = False,
) -> None:
    """Create a project; prints its id."""
    settings = settings_or_exit()
    clock = SystemClock()
    project = run_with_repository(settings, lambda r: accounts.create_project(r, clock, user, name))
    emit(
        project.id,
        as_json,
        {"id": project.id, "userId": user, "name": name, "createdAt": rfc3339(project.created_at)},
    )


@chats_app.command("create")
def chats_create(
    user: Annotated[str, typer.Option("--user", metavar="USER_ID", help="Owner.")],
    project: Annotated[str | None, typer.Option("--project", metavar="PROJECT_ID")] = None,
    title: Annotated[str | None, typer.Option("--title", metavar="TEXT")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Create a chat; prints its id."""
    settings = settings_or_exit()
    clock = SystemClock()
    chat = run_with_repository(
        settings, lambda r: accounts.create_chat(r, clock, user, project, title)
    )
    emit(
        chat.id,
        as_json,
        {
            "id": chat.id,
            "userId": user,
            "projectId": project,
            "title": title,
            "createdAt": rfc3339(chat.created_at),
        },
    )


def _key_json(record: ApiKeyRecord, state: str) -> dict[str, Any]:
    def when(value: Any) -> str | None:
        return None if value is None else rfc3339(value)

    return {
        "id": record.id,
        "userId": record.user_id,
        "projectId": record.project_id,
        "name": record.name,
        "state": state,
        "createdAt": when(record.created_at),
        "expiresAt": when(record.expires_at),
        "revokedAt": when(record.revoked_at),
        "lastUsedAt": when(record.last_used_at),
    }


@keys_app.command("create")
def keys_create(
    user: Annotated[str, typer.Option("--user", metavar="USER_ID", help="Owner.")],
    project: Annotated[
        str | None, typer.Option("--project", metavar="PROJECT_ID", help="Limit to one project.")
    ] = None,
    name: Annotated[str | None, typer.Option("--name", help="A label for the key.")] = None,
    expires_in: Annotated[
        int | None, typer.Option("--expires-in", metavar="SECONDS", min=1, help="Lifetime.")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Create an API key; prints the key (shown only this once)."""
    settings = settings_or_exit()
    clock = SystemClock()
    try:
        pepper = api_key_pepper(settings)
    except ConfigurationError as exc:
        fail(str(exc), 2)
    lifetime = None if expires_in is None else timedelta(seconds=expires_in)
    created = run_with_repository(
        settings,
        lambda r: accounts.create_api_key(
            r, clock, pepper, user, project_id=project, name=name, expires_in=lifetime
        ),
    )
    payload = _key_json(created.record, "active") | {"key": created.key}
    emit(created.key, as_json, payload)


@keys_app.command("list")
def keys_list(
    user: Annotated[str, typer.Option("--user", metavar="USER_ID", help="Owner.")],
    as_json: JsonFlag = False,
) -> None:
    """List a user's keys: one line per key, `KEY_ID<TAB>STATE<TAB>PROJECT<TAB>NAME`."""
    settings = settings_or_exit()
    clock = SystemClock()
    records = run_with_repository(settings, lambda r: accounts.list_api_keys(r, user))
    now = clock.now()
    rows = [(record, accounts.key_state(record, now)) for record in records]
    if as_json:
        typer.echo(json.dumps([_key_json(record, state) for record, state in rows]))
        return
    for record, state in rows:
        typer.echo("\t".join([record.id, state, record.project_id or "-", record.name or "-"]))


@keys_app.command("revoke")
def keys_revoke(
    key_id: Annotated[str, typer.Argument(metavar="KEY_ID")], as_json: JsonFlag = False
) -> None:
    """Revoke a key (it stops working within 5 seconds); prints KEY_ID."""
    settings = settings_or_exit()
    clock = SystemClock()
    run_with_repository(settings, lambda r: accounts.revoke_api_key(r, clock, key_id))
    emit(key_id, as_json, {"id": key_id, "state": "revoked"})


@app.command()
def worker() -> None:
    """Drive launches, watch sandboxes and reconcile, without serving HTTP.

    Run any number beside `serve` (with IVY_RUN_WORKER=false there, or not) on the same
    database; leases make sure one worker drives each launch.
    """
    from ivy_sandbox.bootstrap import engine_settings, make_backend, open_repository
    from ivy_sandbox.storage.sandboxes import SandboxRepository
    from ivy_sandbox.workers.provisioner import Provisioner

    settings = settings_or_exit()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")

    async def main() -> None:
        repository = await open_repository(settings)
        backend = make_backend(settings)
        provisioner = Provisioner(
            SandboxRepository(repository.engine), backend, SystemClock(), engine_settings(settings)
        )
        try:
            await provisioner.run_forever()
        finally:
            await backend.aclose()
            await repository.engine.dispose()

    run_or_fail(main())


# -- client commands (HTTP, IVY_API_URL + IVY_API_KEY) -------------------------------------------
def _client() -> Any:
    from ivy_sandbox.client import Client, IvySandboxClientError

    try:
        return Client()
    except IvySandboxClientError as exc:
        fail(str(exc), 2)


def _client_call(call: Callable[[], T]) -> T:
    from ivy_sandbox.client import IvySandboxClientError, SandboxFailedError

    try:
        return call()
    except SandboxFailedError as exc:
        fail(f"{exc.error_code}: {exc.error_message}")
    except IvySandboxClientError as exc:
        fail(str(exc))


class ProgressLines:
    """Writes one stderr line per visible change of status, phase or ETA."""

    def __init__(self) -> None:
        self.last = ""

    def __call__(self, body: dict[str, Any]) -> None:
        parts = [str(body.get("status", "?"))]
        if "phase" in body:
            parts.append(str(body["phase"]))
        if "etaSeconds" in body:
            parts.append(f"~{body['etaSeconds']} s")
        line = " ".join(parts)
        if line != self.last:
            typer.echo(line, err=True)
            self.last = line


@app.command()
def launch(
    chat_id: Annotated[str, typer.Argument(metavar="CHAT_ID")],
    wait: Annotated[bool, typer.Option("--wait", help="Wait until the sandbox is active.")] = False,
    timeout: Annotated[float, typer.Option(help="With --wait: give up after SECONDS.")] = 300.0,
    as_json: JsonFlag = False,
) -> None:
    """Launch the chat's sandbox; prints its status (with --wait: `active`, or fails)."""
    with _client() as ivy:
        body = _client_call(lambda: ivy.sandbox.launch(chat_id))
        if wait and body.get("status") != "active":
            progress = ProgressLines()
            progress(body)
            body = _client_call(
                lambda: ivy.sandbox.wait_until_ready(chat_id, timeout=timeout, on_progress=progress)
            )
    emit(str(body["status"]), as_json, body)


@app.command()
def status(
    chat_id: Annotated[str, typer.Argument(metavar="CHAT_ID")], as_json: JsonFlag = False
) -> None:
    """Print the sandbox status (`none`, `provisioning`, `active` or `failed`)."""
    with _client() as ivy:
        body = _client_call(lambda: ivy.sandbox.status(chat_id))
    emit(str(body["status"]), as_json, body)


@app.command()
def stop(
    chat_id: Annotated[str, typer.Argument(metavar="CHAT_ID")], as_json: JsonFlag = False
) -> None:
    """Stop the chat's sandbox (the workspace is kept); prints `none`."""
    with _client() as ivy:
        body = _client_call(lambda: ivy.sandbox.stop(chat_id))
    emit(str(body["status"]), as_json, body)


@app.command(
    "exec",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def exec_command(
    chat_id: Annotated[str, typer.Argument(metavar="CHAT_ID")],
    command: Annotated[list[str], typer.Argument(metavar="-- CMD [ARG...]")],
    timeout: Annotated[float, typer.Option(help="Kill the command after SECONDS.")] = 60.0,
) -> None:
    """Run CMD in the chat's sandbox; prints its output and exits with its exit code."""
    stdin = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()
    with _client() as ivy:
        result = _client_call(
            lambda: ivy.sandbox.exec(chat_id, command, timeout_seconds=timeout, stdin=stdin)
        )
    sys.stdout.write(result["stdout"])
    sys.stderr.write(result["stderr"])
    if result.get("truncated"):
        typer.echo("ivy-sandbox: output truncated", err=True)
    if result.get("timedOut"):
        typer.echo(f"ivy-sandbox: timed out after {timeout:g} s", err=True)
    raise typer.Exit(int(result["exitCode"]))


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)

"""Admin commands: direct database access to users, projects, chats and API keys."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Annotated, Any

import typer

from ivy_sandbox.cli.common import JsonFlag, emit, fail, run_with_repository, settings_or_exit
from ivy_sandbox.config import api_key_pepper
from ivy_sandbox.domain.sandbox import rfc3339
from ivy_sandbox.errors import ConfigurationError
from ivy_sandbox.services import accounts
from ivy_sandbox.services.clock import SystemClock
from ivy_sandbox.storage.repository import ApiKeyRecord

admin = typer.Typer(help="Manage users, projects, chats and API keys (direct database access).")
users_app = typer.Typer(help="Users.", no_args_is_help=True)
projects_app = typer.Typer(help="Projects.", no_args_is_help=True)
chats_app = typer.Typer(help="Chats.", no_args_is_help=True)
keys_app = typer.Typer(help="API keys.", no_args_is_help=True)
admin.add_typer(users_app, name="users")
admin.add_typer(projects_app, name="projects")
admin.add_typer(chats_app, name="chats")
admin.add_typer(keys_app, name="keys")


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

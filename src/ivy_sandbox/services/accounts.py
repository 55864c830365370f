"""Use cases for what users own: users, projects, chats and API keys.

Shared by the admin CLI (direct database access) and, later, the user-facing REST API.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from ivy_sandbox.auth.api_keys import generate_api_key, hash_api_key
from ivy_sandbox.domain.ids import is_acceptable_id, new_id
from ivy_sandbox.errors import InvalidRequest, NotFound
from ivy_sandbox.services.clock import Clock
from ivy_sandbox.storage.repository import ApiKeyRecord, ChatRecord, ProjectRecord, Repository

MAX_NAME_LENGTH = 200
MAX_TITLE_LENGTH = 500


@dataclass(frozen=True, slots=True)
class CreatedApiKey:
    """A new key: ``key`` is the secret, shown exactly once and never stored."""

    key: str
    record: ApiKeyRecord


def _require_id(value: str, what: str) -> None:
    if not is_acceptable_id(value):
        raise InvalidRequest(
            f"invalid {what} id",
            detail=f"Invalid {what} id {value!r}: use 1-64 letters, digits, '_' or '-', "
            "starting with a letter or digit.",
        )


def _require_text(value: str | None, what: str, limit: int) -> None:
    """Names and titles: 1..limit printable characters (no tabs, newlines or other controls,
    so listings stay one line per item)."""
    if value is None:
        return
    if not value.strip() or len(value) > limit or not value.isprintable():
        raise InvalidRequest(
            f"invalid {what}",
            detail=f"The {what} must be 1-{limit} printable characters, not blank.",
        )


async def _require_user(repository: Repository, user_id: str) -> None:
    if not await repository.user_exists(user_id):
        raise NotFound(f"user {user_id} not found", detail=f"No user {user_id}.")


async def _require_own_project(
    repository: Repository, user_id: str, project_id: str | None
) -> None:
    if project_id is None:
        return
    project = await repository.project(project_id)
    if project is None or project.user_id != user_id:
        raise NotFound(
            f"project {project_id} not found for {user_id}",
            detail=f"No project {project_id} owned by {user_id}.",
        )


async def create_user(repository: Repository, clock: Clock, user_id: str) -> str:
    _require_id(user_id, "user")
    await repository.create_user(user_id, clock.now())
    return user_id


async def create_project(
    repository: Repository, clock: Clock, user_id: str, name: str
) -> ProjectRecord:
    _require_text(name, "project name", MAX_NAME_LENGTH)
    await _require_user(repository, user_id)
    project = ProjectRecord(id=new_id("proj"), user_id=user_id, name=name, created_at=clock.now())
    await repository.create_project(project)
    return project


async def create_chat(
    repository: Repository,
    clock: Clock,
    user_id: str,
    project_id: str | None = None,
    title: str | None = None,
) -> ChatRecord:
    _require_text(title, "title", MAX_TITLE_LENGTH)
    await _require_user(repository, user_id)
    await _require_own_project(repository, user_id, project_id)
    chat = ChatRecord(
        id=new_id("chat"),
        user_id=user_id,
        project_id=project_id,
        title=title,
        created_at=clock.now(),
    )
    await repository.create_chat(chat)
    return chat


async def create_api_key(
    repository: Repository,
    clock: Clock,
    pepper: bytes,
    user_id: str,
    *,
    project_id: str | None = None,
    name: str | None = None,
    expires_in: timedelta | None = None,
) -> CreatedApiKey:
    _require_text(name, "key name", MAX_NAME_LENGTH)
    if expires_in is not None and expires_in <= timedelta(0):
        raise InvalidRequest("non-positive expiry", detail="The expiry must be in the future.")
    await _require_user(repository, user_id)
    await _require_own_project(repository, user_id, project_id)
    key = generate_api_key()
    now = clock.now()
    record = ApiKeyRecord(
        id=key.kid,
        user_id=user_id,
        project_id=project_id,
        name=name,
        secret_hash=hash_api_key(pepper, key.raw),
        created_at=now,
        expires_at=None if expires_in is None else now + expires_in,
        revoked_at=None,
        last_used_at=None,
    )
    await repository.create_api_key(record)
    return CreatedApiKey(key=key.raw, record=record)


async def list_api_keys(repository: Repository, user_id: str) -> list[ApiKeyRecord]:
    await _require_user(repository, user_id)
    return await repository.list_api_keys(user_id)


async def revoke_api_key(repository: Repository, clock: Clock, kid: str) -> None:
    await repository.revoke_api_key(kid, clock.now())


def key_state(record: ApiKeyRecord, now: datetime) -> str:
    """``active``, ``revoked`` or ``expired`` — what a listing shows."""
    if record.revoked_at is not None:
        return "revoked"
    if record.expires_at is not None and now >= record.expires_at:
        return "expired"
    return "active"

"""Use cases for what users own: users, projects, chats and API keys.

Shared by the admin CLI (direct database access) and, later, the user-facing REST API.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Generic, Protocol, TypeVar

from ivy_sandbox.auth.api_keys import generate_api_key, hash_api_key
from ivy_sandbox.auth.principal import CredentialKind, Principal
from ivy_sandbox.domain.ids import is_acceptable_id, new_id
from ivy_sandbox.errors import InvalidRequest, NotFound, PermissionDenied, SessionRequired
from ivy_sandbox.services.clock import Clock
from ivy_sandbox.storage.repository import (
    ApiKeyRecord,
    ChatRecord,
    PageKey,
    ProjectRecord,
    Repository,
)

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


# -- the user-facing API: what a caller may do with what its user owns ------------------------
# Rules: a project-scoped API key sees only its project; a Clerk session or an unscoped key
# sees everything its user owns; only a Clerk session manages API keys.

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 100
MAX_CURSOR_LENGTH = 512
PROJECT_DENIED = "You do not own this project, or your key's project scope excludes it."
SCOPED_KEY_CANNOT_CREATE_PROJECTS = (
    "A project-scoped API key cannot create projects; use a session or an unscoped key."
)
KEY_NOT_FOUND = "No such API key among yours."
_CURSOR_TEXT = re.compile(r"[A-Za-z0-9_-]+")


class _Keyed(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def created_at(self) -> datetime: ...


KeyedT = TypeVar("KeyedT", bound=_Keyed)


@dataclass(frozen=True, slots=True)
class Page(Generic[KeyedT]):
    """One page of a list, oldest first; ``next_cursor`` is ``None`` on the last page."""

    items: list[KeyedT]
    next_cursor: str | None


def encode_cursor(created_at: datetime, item_id: str) -> str:
    """An opaque cursor: base64url (unpadded) of ``<created_at ISO 8601 UTC>|<id>``."""
    raw = f"{created_at.astimezone(UTC).isoformat()}|{item_id}".encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def decode_cursor(cursor: str) -> PageKey:
    """The position a cursor names; :class:`InvalidRequest` (422) for anything malformed."""
    try:
        if len(cursor) > MAX_CURSOR_LENGTH or not _CURSOR_TEXT.fullmatch(cursor):
            raise ValueError("not base64url")
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode("utf-8")
        stamp, item_id = raw.split("|", 1)
        created_at = datetime.fromisoformat(stamp)
        if created_at.tzinfo is None or not is_acceptable_id(item_id):
            raise ValueError("naive time or bad id")
        created_at = created_at.astimezone(UTC)
    except (ValueError, OverflowError):  # binascii.Error and UnicodeDecodeError included
        raise InvalidRequest(
            "malformed cursor",
            detail="Invalid request: the cursor is malformed; pass nextCursor back as returned.",
        ) from None
    return PageKey(created_at=created_at, id=item_id)


def _page_start(limit: int, cursor: str | None) -> PageKey | None:
    if not 1 <= limit <= MAX_PAGE_SIZE:
        raise InvalidRequest(
            f"page limit {limit} out of range",
            detail=f"Invalid request: limit must be 1-{MAX_PAGE_SIZE}.",
        )
    return None if cursor is None else decode_cursor(cursor)


def _paged(rows: list[KeyedT], limit: int) -> Page[KeyedT]:
    """``rows`` were fetched with ``limit + 1``: one extra row means there is a next page."""
    if len(rows) <= limit:
        return Page(items=rows, next_cursor=None)
    items = rows[:limit]
    return Page(items=items, next_cursor=encode_cursor(items[-1].created_at, items[-1].id))


def require_session(principal: Principal) -> None:
    """Only a Clerk session may manage API keys: a key cannot mint (list, revoke) keys."""
    if principal.kind is not CredentialKind.SESSION:
        raise SessionRequired(
            f"{principal.kind} {principal.credential_id} tried to manage API keys"
        )


async def _usable_project(
    repository: Repository, principal: Principal, project_id: str | None
) -> str | None:
    """The project a request acts in: ``project_id`` when the caller may use it; when none
    is asked for, the key's scope (``None`` for sessions and unscoped keys).

    Missing, another user's, outside the key's scope or malformed: one 403, one body.
    """
    if project_id is None:
        return principal.project_id
    if (
        (principal.project_id is None or project_id == principal.project_id)
        and is_acceptable_id(project_id)
        and await repository.owned_project(project_id, principal.user_id) is not None
    ):
        return project_id
    raise PermissionDenied(
        f"project access denied for {principal.kind} {principal.credential_id}",
        detail=PROJECT_DENIED,
    )


async def create_own_project(
    repository: Repository, clock: Clock, principal: Principal, name: str
) -> ProjectRecord:
    """A new project of the caller's user; a project-scoped key may not create one."""
    if principal.project_id is not None:
        raise PermissionDenied(
            f"scoped {principal.kind} {principal.credential_id} tried to create a project",
            detail=SCOPED_KEY_CANNOT_CREATE_PROJECTS,
        )
    _require_text(name, "project name", MAX_NAME_LENGTH)
    project = ProjectRecord(
        id=new_id("proj"), user_id=principal.user_id, name=name, created_at=clock.now()
    )
    await repository.create_project(project)
    return project


async def list_own_projects(
    repository: Repository, principal: Principal, *, limit: int, cursor: str | None
) -> Page[ProjectRecord]:
    """The user's projects (a scoped key: just its project), one page."""
    after = _page_start(limit, cursor)
    rows = await repository.projects_page(
        principal.user_id, only_project=principal.project_id, after=after, limit=limit + 1
    )
    return _paged(rows, limit)


async def create_own_chat(
    repository: Repository,
    clock: Clock,
    principal: Principal,
    *,
    project_id: str | None = None,
    title: str | None = None,
) -> ChatRecord:
    """A new chat of the caller's user; a scoped key's chats go into its project."""
    _require_text(title, "title", MAX_TITLE_LENGTH)
    project = await _usable_project(repository, principal, project_id)
    chat = ChatRecord(
        id=new_id("chat"),
        user_id=principal.user_id,
        project_id=project,
        title=title,
        created_at=clock.now(),
    )
    await repository.create_chat(chat)
    return chat


async def list_own_chats(
    repository: Repository,
    principal: Principal,
    *,
    project_id: str | None = None,
    limit: int,
    cursor: str | None,
) -> Page[ChatRecord]:
    """The user's chats, in ``project_id`` when given (a scoped key: its project's), one page."""
    after = _page_start(limit, cursor)
    project = await _usable_project(repository, principal, project_id)
    rows = await repository.chats_page(
        principal.user_id, project_id=project, after=after, limit=limit + 1
    )
    return _paged(rows, limit)


async def get_own_chat(repository: Repository, principal: Principal, chat_id: str) -> ChatRecord:
    """The chat, or the sandbox endpoints' uniform 403 — same exception, body and AND
    semantics as :func:`ivy_sandbox.services.sandboxes.authorize_chat` (no existence oracle).
    """
    record = None
    if is_acceptable_id(chat_id):
        record = await repository.owned_chat(chat_id, principal.user_id, principal.project_id)
    if record is None:
        raise PermissionDenied(f"chat access denied for {principal.kind} {principal.credential_id}")
    return record


async def create_own_api_key(
    repository: Repository,
    clock: Clock,
    pepper: bytes,
    principal: Principal,
    *,
    project_id: str | None = None,
    name: str | None = None,
    expires_in: timedelta | None = None,
) -> CreatedApiKey:
    """A new key of the session's user (the key itself is returned this once only)."""
    require_session(principal)
    _require_text(name, "key name", MAX_NAME_LENGTH)
    project = await _usable_project(repository, principal, project_id)
    return await create_api_key(
        repository,
        clock,
        pepper,
        principal.user_id,
        project_id=project,
        name=name,
        expires_in=expires_in,
    )


async def list_own_api_keys(
    repository: Repository, principal: Principal, *, limit: int, cursor: str | None
) -> Page[ApiKeyRecord]:
    """The session's user's keys (revoked and expired ones included), one page."""
    require_session(principal)
    after = _page_start(limit, cursor)
    rows = await repository.api_keys_page(principal.user_id, after=after, limit=limit + 1)
    return _paged(rows, limit)


async def revoke_own_api_key(
    repository: Repository,
    clock: Clock,
    principal: Principal,
    key_id: str,
    *,
    forget_cached: Callable[[], None] = lambda: None,
) -> None:
    """Revoke one of the session's user's keys (idempotent). A missing key and another
    user's key get the same 404 — there is nothing to learn about keys that are not yours.
    ``forget_cached`` drops this process's verification cache, so the key fails here at
    once; other processes stop accepting it within their cache's 5 s."""
    require_session(principal)
    if not is_acceptable_id(key_id) or not await repository.revoke_owned_api_key(
        key_id, principal.user_id, clock.now()
    ):
        raise NotFound(
            f"api key {key_id!r} not among {principal.user_id}'s keys", detail=KEY_NOT_FOUND
        )
    forget_cached()

"""What users own: projects, chats and API keys (DESIGN §7).

Who may do what:

* A Clerk session or an unscoped API key acts on everything its user owns.
* A project-scoped API key sees only its project: it lists just that project and its chats,
  creates chats in it (by default), and cannot create projects.
* API keys are managed only with a Clerk session: an API key gets 403 ``session_required``
  for creating, listing and revoking keys alike (a key can never mint keys).

Ids that are not yours get one answer whatever the cause: a chat → the sandbox endpoints'
uniform 403; a ``projectId`` → one 403 body; a key id → one 404 body.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Response
from starlette.convertors import register_url_convertor

from ivy_sandbox.api.deps import CurrentPrincipal, ServicesDep
from ivy_sandbox.api.routes.sandboxes import AnyTextConvertor
from ivy_sandbox.api.schemas import (
    PAGINATION_DESCRIPTION,
    PROBLEM_RESPONSES,
    ApiKey,
    ApiKeyCreate,
    ApiKeyCreated,
    ApiKeyList,
    Chat,
    ChatCreate,
    ChatList,
    Project,
    ProjectCreate,
    ProjectList,
    problem_doc,
)
from ivy_sandbox.domain.sandbox import rfc3339
from ivy_sandbox.services import accounts
from ivy_sandbox.storage.repository import ApiKeyRecord, ChatRecord, ProjectRecord

# Any chatId text must reach the one authorization decision (uniform 403, never a router 404).
register_url_convertor("anytext", AnyTextConvertor())

router = APIRouter()

Limit = Annotated[
    int,
    Query(
        ge=1,
        le=accounts.MAX_PAGE_SIZE,
        description=f"Page size, 1-{accounts.MAX_PAGE_SIZE}",
        examples=[accounts.DEFAULT_PAGE_SIZE],
    ),
]
Cursor = Annotated[
    str | None,
    Query(
        max_length=accounts.MAX_CURSOR_LENGTH,
        description="The `nextCursor` of the previous page; omit for the first page",
    ),
]

COMMON: dict[int | str, dict[str, Any]] = {
    401: PROBLEM_RESPONSES[401],
    429: PROBLEM_RESPONSES[429],
}
INVALID_QUERY = problem_doc("`limit` out of 1-100, or a malformed `cursor` (`invalid_request`)")
INVALID_BODY = problem_doc("Invalid request body (`invalid_request`)")
PROJECT_FORBIDDEN = problem_doc(
    "`projectId` is not a project you own, or is outside your key's project scope — one body "
    "for every cause (`forbidden`)"
)
SESSION_REQUIRED = problem_doc(
    "Called with an API key: keys are managed only with a Clerk session (`session_required`)"
)

SESSION_ONLY = (
    " Requires a Clerk session (Bearer JWT or the `__session` cookie); an API key gets 403 "
    "`session_required` — a key can never create, list or revoke keys."
)


def _project(record: ProjectRecord) -> Project:
    return Project(id=record.id, name=record.name, createdAt=rfc3339(record.created_at))


def _chat(record: ChatRecord) -> Chat:
    return Chat(
        id=record.id,
        projectId=record.project_id,
        title=record.title,
        createdAt=rfc3339(record.created_at),
    )


def _optional_time(value: datetime | None) -> str | None:
    return None if value is None else rfc3339(value)


def _key_fields(record: ApiKeyRecord, now: datetime) -> dict[str, Any]:
    return {
        "id": record.id,
        "name": record.name,
        "projectId": record.project_id,
        "state": accounts.key_state(record, now),
        "createdAt": rfc3339(record.created_at),
        "expiresAt": _optional_time(record.expires_at),
        "revokedAt": _optional_time(record.revoked_at),
        "lastUsedAt": _optional_time(record.last_used_at),
    }


# -- projects ----------------------------------------------------------------------------------
@router.post(
    "/projects",
    tags=["projects"],
    summary="Create a project",
    description=(
        "Creates a project owned by you. `name`: 1-200 printable characters. A project-scoped "
        "API key cannot create projects (403 `forbidden`); use a session or an unscoped key."
    ),
    operation_id="createProject",
    status_code=201,
    response_model=Project,
    response_description="The new project",
    responses={
        **COMMON,
        403: problem_doc("Called with a project-scoped API key (`forbidden`)"),
        413: PROBLEM_RESPONSES[413],
        422: INVALID_BODY,
    },
)
async def create_project(
    body: ProjectCreate, principal: CurrentPrincipal, services: ServicesDep
) -> Project:
    record = await accounts.create_own_project(
        services.repository, services.clock, principal, body.name
    )
    return _project(record)


@router.get(
    "/projects",
    tags=["projects"],
    summary="List your projects",
    description=(
        "Your projects; with a project-scoped API key, just that project." + PAGINATION_DESCRIPTION
    ),
    operation_id="listProjects",
    response_model=ProjectList,
    response_description="One page of projects",
    responses={**COMMON, 422: INVALID_QUERY},
)
async def list_projects(
    principal: CurrentPrincipal,
    services: ServicesDep,
    limit: Limit = accounts.DEFAULT_PAGE_SIZE,
    cursor: Cursor = None,
) -> ProjectList:
    page = await accounts.list_own_projects(
        services.repository, principal, limit=limit, cursor=cursor
    )
    return ProjectList(items=[_project(r) for r in page.items], nextCursor=page.next_cursor)


# -- chats -------------------------------------------------------------------------------------
@router.post(
    "/chats",
    tags=["chats"],
    summary="Create a chat",
    description=(
        "Creates a chat owned by you, optionally in one of your projects (`projectId`) and "
        "with a `title` (1-500 printable characters). The body may be omitted. With a "
        "project-scoped API key the chat goes into the key's project; any other `projectId` "
        "is refused. A `projectId` you may not use — missing, another user's, outside your "
        "key's scope or malformed — gets one identical 403."
    ),
    operation_id="createChat",
    status_code=201,
    response_model=Chat,
    response_description="The new chat",
    responses={**COMMON, 403: PROJECT_FORBIDDEN, 413: PROBLEM_RESPONSES[413], 422: INVALID_BODY},
)
async def create_chat(
    principal: CurrentPrincipal, services: ServicesDep, body: ChatCreate | None = None
) -> Chat:
    body = body or ChatCreate()
    record = await accounts.create_own_chat(
        services.repository,
        services.clock,
        principal,
        project_id=body.projectId,
        title=body.title,
    )
    return _chat(record)


@router.get(
    "/chats",
    tags=["chats"],
    summary="List your chats",
    description=(
        "Your chats, or those of one project (`projectId`); with a project-scoped API key, "
        "only its project's chats (another `projectId` gets 403). A `projectId` you may not "
        "use gets the same 403 body whatever the cause." + PAGINATION_DESCRIPTION
    ),
    operation_id="listChats",
    response_model=ChatList,
    response_description="One page of chats",
    responses={**COMMON, 403: PROJECT_FORBIDDEN, 422: INVALID_QUERY},
)
async def list_chats(
    principal: CurrentPrincipal,
    services: ServicesDep,
    project_id: Annotated[
        str | None,
        Query(
            alias="projectId",
            description="Only this project's chats",
            examples=["proj_3kTqV8bW1nZr0aXy5LmQ"],
        ),
    ] = None,
    limit: Limit = accounts.DEFAULT_PAGE_SIZE,
    cursor: Cursor = None,
) -> ChatList:
    page = await accounts.list_own_chats(
        services.repository, principal, project_id=project_id, limit=limit, cursor=cursor
    )
    return ChatList(items=[_chat(r) for r in page.items], nextCursor=page.next_cursor)


@router.get(
    "/chats/{chatId:anytext}",
    tags=["chats"],
    summary="Get a chat",
    description=(
        "One of your chats. A chat that does not exist, is another user's, is outside your "
        "key's project scope, or a malformed id: the same 403 as the sandbox endpoints, "
        "byte for byte."
    ),
    operation_id="getChat",
    response_model=Chat,
    response_description="The chat",
    responses={**COMMON, 403: PROBLEM_RESPONSES[403]},
)
async def get_chat(
    chat_id: Annotated[
        str,
        Path(alias="chatId", description="ID of the chat", examples=["chat_7PzR2mWq9XcVb4NtYk1s"]),
    ],
    principal: CurrentPrincipal,
    services: ServicesDep,
) -> Chat:
    return _chat(await accounts.get_own_chat(services.repository, principal, chat_id))


# -- API keys ----------------------------------------------------------------------------------
@router.post(
    "/api-keys",
    tags=["api-keys"],
    summary="Create an API key",
    description=(
        "Creates an API key for you and returns it in `key` — this one time only: it is "
        "stored hashed and can never be shown again. Optionally limited to one of your "
        "projects (`projectId`; one 403 body for a project you may not use) and to a "
        "lifetime (`expiresInSeconds`). The body may be omitted." + SESSION_ONLY
    ),
    operation_id="createApiKey",
    status_code=201,
    response_model=ApiKeyCreated,
    response_description="The new key's record and the key itself (shown once)",
    responses={
        **COMMON,
        403: problem_doc(
            "Called with an API key (`session_required`), or `projectId` is not a project "
            "you own (`forbidden`)"
        ),
        413: PROBLEM_RESPONSES[413],
        422: INVALID_BODY,
    },
)
async def create_api_key(
    principal: CurrentPrincipal, services: ServicesDep, body: ApiKeyCreate | None = None
) -> ApiKeyCreated:
    body = body or ApiKeyCreate()
    created = await accounts.create_own_api_key(
        services.repository,
        services.clock,
        services.pepper,
        principal,
        project_id=body.projectId,
        name=body.name,
        expires_in=None
        if body.expiresInSeconds is None
        else timedelta(seconds=body.expiresInSeconds),
    )
    return ApiKeyCreated(**_key_fields(created.record, services.clock.now()), key=created.key)


@router.get(
    "/api-keys",
    tags=["api-keys"],
    summary="List your API keys",
    description=(
        "Your API keys with their state (`active`, `revoked`, `expired`); never a secret."
        + PAGINATION_DESCRIPTION
        + SESSION_ONLY
    ),
    operation_id="listApiKeys",
    response_model=ApiKeyList,
    response_description="One page of API keys",
    responses={**COMMON, 403: SESSION_REQUIRED, 422: INVALID_QUERY},
)
async def list_api_keys(
    principal: CurrentPrincipal,
    services: ServicesDep,
    limit: Limit = accounts.DEFAULT_PAGE_SIZE,
    cursor: Cursor = None,
) -> ApiKeyList:
    page = await accounts.list_own_api_keys(
        services.repository, principal, limit=limit, cursor=cursor
    )
    now = services.clock.now()
    return ApiKeyList(
        items=[ApiKey(**_key_fields(r, now)) for r in page.items],
        nextCursor=page.next_cursor,
    )


@router.delete(
    "/api-keys/{keyId:anytext}",
    tags=["api-keys"],
    summary="Revoke an API key",
    description=(
        "Revokes one of your API keys (idempotent: revoking a revoked key is 204 again and "
        "keeps the first revocation time). This server refuses the key at once; every other "
        "server process within 5 seconds. A key id that is not one of your keys — missing, "
        "another user's, or malformed — gets one identical 404." + SESSION_ONLY
    ),
    operation_id="revokeApiKey",
    status_code=204,
    response_class=Response,
    response_description="Revoked",
    responses={
        **COMMON,
        403: SESSION_REQUIRED,
        404: problem_doc(
            "Not one of your keys; missing and other users' keys get the same body (`not_found`)"
        ),
    },
)
async def revoke_api_key(
    key_id: Annotated[
        str,
        Path(alias="keyId", description="The key's `id`", examples=["AbC123xYz789"]),
    ],
    principal: CurrentPrincipal,
    services: ServicesDep,
) -> Response:
    await accounts.revoke_own_api_key(
        services.repository,
        services.clock,
        principal,
        key_id,
        forget_cached=services.authenticator.forget_cached_keys,
    )
    return Response(status_code=204)

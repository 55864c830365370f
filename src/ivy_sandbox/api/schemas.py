"""Wire schemas that are not domain shapes: the problem body and the documented errors."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator

from ivy_sandbox.domain.sandbox import StatusBody


class Problem(BaseModel):
    """An error body (RFC 9457 problem details) with a stable ``code``."""

    type: str = Field(examples=["urn:ivy-sandbox:error:forbidden"])
    title: str = Field(examples=["Forbidden"])
    status: int = Field(examples=[403])
    detail: str
    code: str = Field(description="Stable machine-readable error code", examples=["forbidden"])


PROBLEM_REF = "#/components/schemas/Problem"


def _problem(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": description,
        "content": {"application/problem+json": {"schema": {"$ref": PROBLEM_REF}}},
    }
    if headers:
        response["headers"] = headers
    return response


PROBLEM_RESPONSES: dict[int, dict[str, Any]] = {
    401: _problem(
        "Authentication required",
        {"WWW-Authenticate": {"schema": {"type": "string"}, "description": "Bearer challenge"}},
    ),
    403: _problem("You do not own this chat, or your key's project scope excludes it"),
    409: _problem("The sandbox is not in a state that allows this"),
    413: _problem("Request body too large"),
    422: _problem("Invalid request body"),
    429: _problem(
        "Rate limit exceeded",
        {
            "Retry-After": {"schema": {"type": "integer"}, "description": "Seconds to wait"},
            "RateLimit-Policy": {"schema": {"type": "string"}},
            "RateLimit": {"schema": {"type": "string"}},
        },
    ),
}


# -- examples for the sandbox operations -----------------------------------------------------
# Realistic bodies, one per state a client must handle: the OpenAPI document is the first
# thing an integrator reads, and an example per state shows which fields come with which.
EXAMPLE_CREATED_AT = "2026-11-29T10:02:02.571Z"
STATUS_EXAMPLES: dict[str, dict[str, Any]] = {
    "provisioning": {
        "summary": "Launching: the workspace is being mounted",
        "value": {
            "status": "provisioning",
            "phase": "mount",
            "etaSeconds": 4,
            "createdAt": EXAMPLE_CREATED_AT,
        },
    },
    "active": {
        "summary": "Ready to run commands",
        "value": {"status": "active", "phase": "ready", "createdAt": EXAMPLE_CREATED_AT},
    },
    "failed": {
        "summary": "The launch failed",
        "value": {
            "status": "failed",
            "phase": "failed",
            "errorMessage": "mount: the workspace could not be attached at /workspace",
            "createdAt": EXAMPLE_CREATED_AT,
        },
    },
    "none": {"summary": "The chat has no sandbox", "value": {"status": "none"}},
}


def status_response(description: str, *states: str) -> dict[str, Any]:
    """A documented status-body response (for ``responses=``) with an example of each of
    ``states`` — the ones this operation can actually answer with."""
    return {
        "model": StatusBody,
        "description": description,
        "content": {"application/json": {"examples": {s: STATUS_EXAMPLES[s] for s in states}}},
    }


EXAMPLE_EVENT_STREAM = (
    "retry: 2000\n\n"
    "id: b3b3fe8e1ffd2ca3\nevent: status\n"
    'data: {"status":"provisioning","phase":"compute","etaSeconds":6,'
    f'"createdAt":"{EXAMPLE_CREATED_AT}"}}\n\n'
    ": keep-alive\n\n"
    "id: f2b6e59761c37e2c\nevent: status\n"
    'data: {"status":"provisioning","phase":"mount","etaSeconds":4,'
    f'"createdAt":"{EXAMPLE_CREATED_AT}"}}\n\n'
    "id: 79536a9a99ab492f\nevent: status\n"
    f'data: {{"status":"active","phase":"ready","createdAt":"{EXAMPLE_CREATED_AT}"}}\n\n'
)

EXAMPLE_EXEC_BODY: dict[str, Any] = {
    "command": ["python", "-c", "import sys; print(sys.stdin.read().upper())"],
    "timeoutSeconds": 30,
    "cwd": "/workspace",
    "env": {"PYTHONUNBUFFERED": "1"},
    "stdin": "hello from the workspace",
}
EXAMPLE_EXEC_RESPONSE: dict[str, Any] = {
    "exitCode": 0,
    "stdout": "HELLO FROM THE WORKSPACE\n",
    "stderr": "",
    "durationMs": 48,
    "truncated": False,
    "timedOut": False,
}


ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


class ExecBody(BaseModel):
    """A command to run in the chat's active sandbox."""

    model_config = {"extra": "forbid", "json_schema_extra": {"examples": [EXAMPLE_EXEC_BODY]}}

    command: list[Annotated[str, Field(max_length=65536)]] = Field(
        min_length=1,
        max_length=4096,
        description="Program and arguments (no shell unless you run one).",
        examples=[EXAMPLE_EXEC_BODY["command"]],
    )
    timeoutSeconds: float = Field(  # noqa: N815 - wire name
        default=60.0,
        gt=0,
        description="Kill the command (and everything it started) after this many seconds.",
        examples=[EXAMPLE_EXEC_BODY["timeoutSeconds"]],
    )
    cwd: str = Field(
        default="/workspace", pattern=r"^/", max_length=4096, examples=[EXAMPLE_EXEC_BODY["cwd"]]
    )
    env: dict[Annotated[str, Field(pattern=ENV_NAME, max_length=256)], str] = Field(
        default_factory=dict, max_length=256, examples=[EXAMPLE_EXEC_BODY["env"]]
    )
    stdin: str = Field(
        default="",
        description="Text written to the command's standard input.",
        examples=[EXAMPLE_EXEC_BODY["stdin"]],
    )

    @field_validator("command", "env", "cwd", "stdin")
    @classmethod
    def _no_nul(cls, value: Any) -> Any:
        texts = value if isinstance(value, list) else [value]
        if isinstance(value, dict):
            texts = [*value.keys(), *value.values()]
        if any("\x00" in text for text in texts):
            raise ValueError("must not contain NUL characters")
        return value


class ExecResponse(BaseModel):
    model_config = {"json_schema_extra": {"examples": [EXAMPLE_EXEC_RESPONSE]}}

    exitCode: int = Field(description="Exit status; 128+N when killed by signal N")  # noqa: N815
    stdout: str = Field(description="Standard output (UTF-8, invalid bytes replaced)")
    stderr: str
    durationMs: int  # noqa: N815
    truncated: bool = Field(description="Output was cut at the server's limit")
    timedOut: bool = Field(description="The command was killed by timeoutSeconds")  # noqa: N815


class PhaseEntry(BaseModel):
    phase: Literal["compute", "mount", "ready"]
    startedAt: datetime  # noqa: N815
    # Not required in the schema although the server always sends it: FastAPI drops nulls
    # from the document's examples, and the example of a running phase must still validate.
    endedAt: datetime | None = Field(  # noqa: N815
        default=None, description="null while the phase is running"
    )


class Waiting(BaseModel):
    reason: Literal["capacity"]
    queuePosition: int = Field(ge=1)  # noqa: N815


def _phase(phase: str, started: str, ended: str | None) -> dict[str, Any]:
    return {"phase": phase, "startedAt": f"2026-11-29T10:{started}Z", "endedAt": ended}


EXAMPLE_SANDBOX_ID = "sbx_9fLx2QpT7vWm4RkZc8Yd"
SANDBOX_DETAIL_EXAMPLES: list[dict[str, Any]] = [
    {  # active: the whole timeline, closed
        "status": "active",
        "phase": "ready",
        "createdAt": EXAMPLE_CREATED_AT,
        "sandboxId": EXAMPLE_SANDBOX_ID,
        "backend": "local",
        "phases": [
            _phase("compute", "02:02.571", "2026-11-29T10:02:03.210Z"),
            _phase("mount", "02:03.210", "2026-11-29T10:02:04.032Z"),
            _phase("ready", "02:04.032", "2026-11-29T10:02:04.498Z"),
        ],
        "readyAt": "2026-11-29T10:02:04.498Z",
        "lastActivityAt": "2026-11-29T10:07:41.120Z",
    },
    {  # queued: no ETA while it waits for a slot
        "status": "provisioning",
        "phase": "compute",
        "createdAt": EXAMPLE_CREATED_AT,
        "sandboxId": EXAMPLE_SANDBOX_ID,
        "backend": "local",
        "phases": [_phase("compute", "02:02.571", None)],
        "waiting": {"reason": "capacity", "queuePosition": 2},
    },
    {  # failed: errorCode is the stable part, errorMessage the readable one
        "status": "failed",
        "phase": "failed",
        "errorMessage": "mount: the workspace could not be attached at /workspace",
        "createdAt": EXAMPLE_CREATED_AT,
        "sandboxId": EXAMPLE_SANDBOX_ID,
        "backend": "local",
        "errorCode": "mount_failed",
        "phases": [
            _phase("compute", "02:02.571", "2026-11-29T10:02:03.210Z"),
            _phase("mount", "02:03.210", "2026-11-29T10:02:08.215Z"),
        ],
    },
    {"status": "none"},
]


class SandboxDetail(BaseModel):
    """The full record of the chat's sandbox: the status fields and the story behind them."""

    model_config = {"json_schema_extra": {"examples": [*SANDBOX_DETAIL_EXAMPLES]}}

    status: Literal["none", "provisioning", "active", "failed"]
    phase: Literal["compute", "mount", "ready", "failed"] | None = None
    etaSeconds: int | None = Field(default=None, ge=0)  # noqa: N815
    errorMessage: str | None = None  # noqa: N815
    createdAt: datetime | None = None  # noqa: N815
    sandboxId: str | None = None  # noqa: N815
    backend: str | None = None
    errorCode: str | None = Field(  # noqa: N815
        default=None, description="Stable failure code, e.g. mount_failed, readiness_timeout"
    )
    phases: list[PhaseEntry] | None = None
    readyAt: datetime | None = None  # noqa: N815
    lastActivityAt: datetime | None = None  # noqa: N815
    waiting: Waiting | None = Field(
        default=None, description="Present while the launch waits for capacity"
    )


# -- what users own: projects, chats and API keys ------------------------------------------
Timestamp = Annotated[
    str,
    Field(
        json_schema_extra={"format": "date-time"},
        description="RFC 3339, UTC, millisecond precision",
        examples=["2026-11-29T10:02:02.571Z"],
    ),
]

PAGINATION_DESCRIPTION = (
    " Paginated: up to `limit` items (1-100, default 50), oldest first; pass `nextCursor` back "
    "as `cursor` for the next page (`null` on the last page). Items created during a walk "
    "appear at its end, never twice."
)

EXAMPLE_PROJECT: dict[str, Any] = {
    "id": "proj_3kTqV8bW1nZr0aXy5LmQ",
    "name": "Protein folding",
    "createdAt": "2026-11-29T10:02:02.571Z",
}
EXAMPLE_CHAT: dict[str, Any] = {
    "id": "chat_7PzR2mWq9XcVb4NtYk1s",
    "projectId": "proj_3kTqV8bW1nZr0aXy5LmQ",
    "title": "Fold 1UBQ",
    "createdAt": "2026-11-29T10:02:02.571Z",
}
EXAMPLE_API_KEY: dict[str, Any] = {
    "id": "AbC123xYz789",
    "name": "CI runner",
    "projectId": "proj_3kTqV8bW1nZr0aXy5LmQ",
    "state": "active",
    "createdAt": "2026-11-29T10:02:02.571Z",
    "expiresAt": "2026-12-29T10:02:02.571Z",
    "revokedAt": None,
    "lastUsedAt": "2026-11-29T10:05:00.000Z",
}
EXAMPLE_KEY = "ivy_AbC123xYz789_5hQ2nR8tW1vX4yZ7aB0cD3eF6gH9iJ2kL5mN8"
EXAMPLE_CURSOR = "MjAyNi0xMS0yOVQxMDowMjowMi41NzE0MTIrMDA6MDB8cHJval8za1RxVjhiVzFuWnIwYVh5NUxtUQ"
NEXT_CURSOR_DESCRIPTION = "Pass as `cursor` for the next page; null on the last page"


class ProjectCreate(BaseModel):
    model_config = {
        "extra": "forbid",
        "json_schema_extra": {"examples": [{"name": "Protein folding"}]},
    }

    name: str = Field(
        min_length=1,
        max_length=200,
        description="1-200 printable characters, not blank",
        examples=["Protein folding"],
    )


class Project(BaseModel):
    model_config = {"json_schema_extra": {"examples": [EXAMPLE_PROJECT]}}

    id: str = Field(examples=[EXAMPLE_PROJECT["id"]])
    name: str = Field(examples=[EXAMPLE_PROJECT["name"]])
    createdAt: Timestamp  # noqa: N815


class ProjectList(BaseModel):
    model_config = {
        "json_schema_extra": {
            "examples": [{"items": [EXAMPLE_PROJECT], "nextCursor": EXAMPLE_CURSOR}]
        }
    }

    items: list[Project]
    nextCursor: str | None = Field(  # noqa: N815
        description=NEXT_CURSOR_DESCRIPTION, examples=[EXAMPLE_CURSOR]
    )


class ChatCreate(BaseModel):
    model_config = {
        "extra": "forbid",
        "json_schema_extra": {
            "examples": [{"projectId": EXAMPLE_CHAT["projectId"], "title": EXAMPLE_CHAT["title"]}]
        },
    }

    projectId: str | None = Field(  # noqa: N815
        default=None,
        description=(
            "A project you own. Defaults to a project-scoped key's project; another project "
            "than the key's is refused with 403."
        ),
        examples=[EXAMPLE_CHAT["projectId"]],
    )
    title: str | None = Field(
        default=None,
        min_length=1,
        max_length=500,
        description="1-500 printable characters, not blank",
        examples=[EXAMPLE_CHAT["title"]],
    )


class Chat(BaseModel):
    model_config = {"json_schema_extra": {"examples": [EXAMPLE_CHAT]}}

    id: str = Field(examples=[EXAMPLE_CHAT["id"]])
    projectId: str | None = Field(  # noqa: N815
        description="The chat's project; null when it is in none",
        examples=[EXAMPLE_CHAT["projectId"]],
    )
    title: str | None = Field(examples=[EXAMPLE_CHAT["title"]])
    createdAt: Timestamp  # noqa: N815


class ChatList(BaseModel):
    model_config = {
        "json_schema_extra": {"examples": [{"items": [EXAMPLE_CHAT], "nextCursor": None}]}
    }

    items: list[Chat]
    nextCursor: str | None = Field(  # noqa: N815
        description=NEXT_CURSOR_DESCRIPTION, examples=[None]
    )


MAX_KEY_LIFETIME_SECONDS = 10 * 365 * 24 * 3600


class ApiKeyCreate(BaseModel):
    model_config = {
        "extra": "forbid",
        "json_schema_extra": {
            "examples": [
                {
                    "name": "CI runner",
                    "projectId": EXAMPLE_API_KEY["projectId"],
                    "expiresInSeconds": 2592000,
                }
            ]
        },
    }

    name: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        description="1-200 printable characters, not blank",
        examples=["CI runner"],
    )
    projectId: str | None = Field(  # noqa: N815
        default=None,
        description="Limit the key to this project you own; omit for all your projects",
        examples=[EXAMPLE_API_KEY["projectId"]],
    )
    expiresInSeconds: int | None = Field(  # noqa: N815
        default=None,
        ge=1,
        le=MAX_KEY_LIFETIME_SECONDS,
        description="Lifetime in seconds (at most ten years); omit for a key that never expires",
        examples=[2592000],
    )


class ApiKey(BaseModel):
    """An API key's record. The secret is never part of it."""

    model_config = {"json_schema_extra": {"examples": [EXAMPLE_API_KEY]}}

    id: str = Field(
        description="The key's public id (the part after `ivy_`); use it to revoke the key",
        examples=[EXAMPLE_API_KEY["id"]],
    )
    name: str | None = Field(examples=[EXAMPLE_API_KEY["name"]])
    projectId: str | None = Field(  # noqa: N815
        description="The project the key is limited to; null: all your projects",
        examples=[EXAMPLE_API_KEY["projectId"]],
    )
    state: Literal["active", "revoked", "expired"] = Field(examples=["active"])
    createdAt: Timestamp  # noqa: N815
    expiresAt: Timestamp | None  # noqa: N815
    revokedAt: Timestamp | None  # noqa: N815
    lastUsedAt: Timestamp | None = Field(  # noqa: N815
        description="Last successful use, to the minute"
    )


class ApiKeyCreated(ApiKey):
    """A new key's record and, this one time only, the key itself."""

    model_config = {
        "json_schema_extra": {
            "examples": [
                EXAMPLE_API_KEY | {"lastUsedAt": None, "key": EXAMPLE_KEY},
            ]
        }
    }

    key: str = Field(
        description="The API key. Shown only in this response: store it now; it cannot be "
        "retrieved again.",
        examples=[EXAMPLE_KEY],
    )


class ApiKeyList(BaseModel):
    model_config = {
        "json_schema_extra": {"examples": [{"items": [EXAMPLE_API_KEY], "nextCursor": None}]}
    }

    items: list[ApiKey]
    nextCursor: str | None = Field(  # noqa: N815
        description=NEXT_CURSOR_DESCRIPTION, examples=[None]
    )


def problem_doc(description: str) -> dict[str, Any]:
    """A documented error response (for ``responses=``): the Problem body, this description."""
    return _problem(description)

"""Wire schemas that are not domain shapes: the problem body and the documented errors."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator


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


ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


class ExecBody(BaseModel):
    """A command to run in the chat's active sandbox."""

    model_config = {"extra": "forbid"}

    command: list[Annotated[str, Field(max_length=65536)]] = Field(
        min_length=1,
        max_length=4096,
        description="Program and arguments (no shell unless you run one).",
        examples=[["ls", "-la", "/workspace"]],
    )
    timeoutSeconds: float = Field(  # noqa: N815 - wire name
        default=60.0,
        gt=0,
        description="Kill the command (and everything it started) after this many seconds.",
    )
    cwd: str = Field(default="/workspace", pattern=r"^/", max_length=4096)
    env: dict[Annotated[str, Field(pattern=ENV_NAME, max_length=256)], str] = Field(
        default_factory=dict, max_length=256
    )
    stdin: str = Field(default="", description="Text written to the command's standard input.")

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
    exitCode: int = Field(description="Exit status; 128+N when killed by signal N")  # noqa: N815
    stdout: str = Field(description="Standard output (UTF-8, invalid bytes replaced)")
    stderr: str
    durationMs: int  # noqa: N815
    truncated: bool = Field(description="Output was cut at the server's limit")
    timedOut: bool = Field(description="The command was killed by timeoutSeconds")  # noqa: N815


class PhaseEntry(BaseModel):
    phase: Literal["compute", "mount", "ready"]
    startedAt: datetime  # noqa: N815
    endedAt: datetime | None  # noqa: N815


class Waiting(BaseModel):
    reason: Literal["capacity"]
    queuePosition: int = Field(ge=1)  # noqa: N815


class SandboxDetail(BaseModel):
    """The full record of the chat's sandbox: the status fields and the story behind them."""

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

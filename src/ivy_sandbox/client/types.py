"""The shapes the API answers with, as typed dictionaries (the JSON, field for field)."""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

__all__ = ["ExecResult", "SandboxDetail", "StatusBody"]


class StatusBody(TypedDict):
    """``GET /v1/sandbox/{chatId}/status``: ``status`` always; ``phase`` and ``createdAt`` when
    a sandbox exists; ``etaSeconds`` while provisioning with an estimate; ``errorMessage`` when
    failed. Absent fields are left out, never ``None``."""

    status: Literal["none", "provisioning", "active", "failed"]
    phase: NotRequired[Literal["compute", "mount", "ready", "failed"]]
    etaSeconds: NotRequired[int]
    errorMessage: NotRequired[str]
    createdAt: NotRequired[str]


class SandboxDetail(TypedDict, total=False):
    """``GET /v1/sandbox/{chatId}``: the status fields plus the record behind them."""

    status: Literal["none", "provisioning", "active", "failed"]
    phase: Literal["compute", "mount", "ready", "failed"]
    etaSeconds: int
    errorMessage: str
    createdAt: str
    sandboxId: str
    backend: str
    errorCode: str
    phases: list[dict[str, Any]]
    readyAt: str
    lastActivityAt: str
    waiting: dict[str, Any]


class ExecResult(TypedDict):
    """``POST /v1/sandbox/{chatId}/exec``."""

    exitCode: int
    stdout: str
    stderr: str
    durationMs: int
    truncated: bool
    timedOut: bool

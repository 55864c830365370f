"""Sandbox states and the exact status body of ``GET /v1/sandbox/{chatId}/status``.

The body follows the seed page: ``status`` always; ``phase`` and ``createdAt`` whenever a
sandbox exists; ``etaSeconds`` (integer >= 0) only while provisioning and when an estimate is
known; ``errorMessage`` only when failed. Absent fields are omitted, never null.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Literal, NotRequired

from pydantic import Field
from typing_extensions import TypedDict


class SandboxStatus(StrEnum):
    NONE = "none"
    PROVISIONING = "provisioning"
    ACTIVE = "active"
    FAILED = "failed"


class Phase(StrEnum):
    COMPUTE = "compute"
    MOUNT = "mount"
    READY = "ready"
    FAILED = "failed"


# Which phases each status may be in (DESIGN §2 invariants).
ALLOWED_PHASES: dict[SandboxStatus, frozenset[Phase]] = {
    SandboxStatus.PROVISIONING: frozenset({Phase.COMPUTE, Phase.MOUNT, Phase.READY}),
    SandboxStatus.ACTIVE: frozenset({Phase.READY}),
    SandboxStatus.FAILED: frozenset({Phase.FAILED}),
}


class StatusBody(TypedDict):
    """Current sandbox state (the seed page's response shape, field for field)."""

    status: Annotated[
        Literal["none", "provisioning", "active", "failed"],
        Field(
            description="`none` when the chat has no sandbox, `provisioning` while starting, "
            "`active` when usable, `failed` otherwise"
        ),
    ]
    phase: NotRequired[
        Annotated[
            Literal["compute", "mount", "ready", "failed"],
            Field(description="Launch phase of the sandbox"),
        ]
    ]
    etaSeconds: NotRequired[
        Annotated[int, Field(ge=0, description="Estimated seconds until ready, when known")]
    ]
    errorMessage: NotRequired[
        Annotated[str, Field(description="Failure reason; present only when `status` is `failed`")]
    ]
    createdAt: NotRequired[Annotated[str, Field(json_schema_extra={"format": "date-time"})]]


@dataclass(frozen=True, slots=True)
class SandboxSnapshot:
    """What the status endpoint needs to know about a chat's current sandbox."""

    status: SandboxStatus
    phase: Phase
    created_at: datetime
    phase_started_at: datetime
    eta_seconds: float | None = None  # estimate of seconds to ready, as of phase_started_at
    error_message: str | None = None


@functools.lru_cache(maxsize=4096)  # a polled sandbox's createdAt, formatted once
def rfc3339(value: datetime) -> str:
    """UTC, millisecond precision, ``Z`` suffix: ``2026-11-29T10:02:02.571Z``."""
    if value.tzinfo is not UTC:
        value = value.astimezone(UTC)
    # isoformat is C code; strftime + an f-string cost three times as much (hot: every poll).
    return value.replace(tzinfo=None).isoformat(timespec="milliseconds") + "Z"


def remaining_eta(snapshot: SandboxSnapshot, now: datetime) -> int | None:
    """Seconds still expected, counting down from the estimate made when the phase began."""
    if snapshot.status is not SandboxStatus.PROVISIONING or snapshot.eta_seconds is None:
        return None
    elapsed = (now - snapshot.phase_started_at).total_seconds()
    # Nearest whole second (half up): ceil would overstate every estimate by half a second
    # on average, a large error for launches that take a few seconds.
    return max(0, math.floor(snapshot.eta_seconds - max(0.0, elapsed) + 0.5))


def status_body(snapshot: SandboxSnapshot | None, now: datetime) -> StatusBody:
    """The seed's response shape for ``snapshot`` (``None``: the chat has no sandbox)."""
    if snapshot is None:
        return {"status": "none"}
    body: StatusBody = {"status": snapshot.status.value, "phase": snapshot.phase.value}
    eta = remaining_eta(snapshot, now)
    if eta is not None:
        body["etaSeconds"] = eta
    if snapshot.status is SandboxStatus.FAILED:
        body["errorMessage"] = snapshot.error_message or "The sandbox failed."
    body["createdAt"] = rfc3339(snapshot.created_at)
    return body

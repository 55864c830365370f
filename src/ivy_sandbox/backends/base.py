"""The contract between the lifecycle engine and a place where sandboxes run.

In the spirit of JupyterHub's Spawner: the engine owns the state machine, the database and
the timeouts; a backend only knows how to start, attach, probe, run in, inspect and stop one
sandbox. A backend keeps whatever it needs to find its sandbox again (pids, cgroup paths,
pod names) in an opaque JSON object, :data:`BackendState`, which the engine stores in the
sandbox's ``backend_state`` column after every step — so a restarted control plane (or
another worker) can adopt or reap what an earlier one started.

Calls map to phases:

* ``start``  — *compute*: the isolated environment exists and its first process runs.
* ``mount``  — *mount*: the chat's workspace is attached at ``/workspace`` and verified
  from inside the sandbox.
* ``probe``  — *ready*: a command runs inside the sandbox and sees the workspace.
* ``exec``   — run a user's command (only while active).
* ``inspect``— is it still there? (liveness for active sandboxes and reconciliation)
* ``stop``   — remove everything but the workspace; idempotent, works on partial state.
* ``list_sandboxes`` — what the backend itself believes is running (to reap orphans).

Errors: a backend raises :class:`BackendError` with a stable ``code`` (see
:class:`ErrorCode`) and a human message; the engine turns it into ``failed``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

BackendState = dict[str, Any]


class ErrorCode(StrEnum):
    """Stable failure codes shown as ``errorCode`` (DESIGN §4). Never reworded."""

    CAPACITY_TIMEOUT = "capacity_timeout"
    COMPUTE_FAILED = "compute_failed"
    COMPUTE_TIMEOUT = "compute_timeout"
    MOUNT_FAILED = "mount_failed"
    MOUNT_TIMEOUT = "mount_timeout"
    READINESS_FAILED = "readiness_failed"
    READINESS_TIMEOUT = "readiness_timeout"
    SANDBOX_EXITED = "sandbox_exited"
    BACKEND_UNAVAILABLE = "backend_unavailable"
    INTERNAL_ERROR = "internal_error"  # a bug on our side; the log has the traceback
    CONTROL_PLANE_LOST = "control_plane_lost"


class BackendError(Exception):
    """A backend step failed; ``message`` is shown to users, so it holds no secrets."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class ResourceLimits:
    memory_bytes: int | None = 512 * 1024 * 1024
    pids: int | None = 256
    cpus: float | None = 1.0  # CPU time as a number of cores


@dataclass(frozen=True, slots=True)
class SandboxSpec:
    """What to run: which sandbox, for which chat, with which limits."""

    sandbox_id: str
    chat_id: str  # validated: [A-Za-z0-9][A-Za-z0-9_-]{0,63}, safe as a path component
    network: bool = False
    limits: ResourceLimits = field(default_factory=ResourceLimits)


@dataclass(frozen=True, slots=True)
class ExecRequest:
    command: list[str]
    timeout_seconds: float = 60.0
    cwd: str = "/workspace"
    env: dict[str, str] = field(default_factory=dict)
    stdin: bytes = b""
    output_limit_bytes: int = 1024 * 1024  # per stream


@dataclass(frozen=True, slots=True)
class ExecResult:
    exit_code: int  # 128+N when killed by signal N (as a shell reports it)
    stdout: bytes
    stderr: bytes
    duration_ms: int
    truncated: bool  # either stream hit output_limit_bytes
    timed_out: bool


class Liveness(StrEnum):
    RUNNING = "running"
    EXITED = "exited"  # the sandbox's processes ended; exit status may be known
    GONE = "gone"  # nothing of it is left, or the state does not describe a sandbox


@dataclass(frozen=True, slots=True)
class Inspection:
    liveness: Liveness
    exit_status: int | None = None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class EnforcedLimits:
    """What the machine lets a backend enforce, reported once at start-up."""

    memory: str  # e.g. "cgroup v1", "cgroup v2", "rlimit (RLIMIT_AS)", "none"
    pids: str
    cpu: str

    def summary(self) -> str:
        return f"memory: {self.memory}; pids: {self.pids}; cpu: {self.cpu}"


class SandboxBackend(Protocol):
    name: str

    def enforced_limits(self) -> EnforcedLimits: ...

    async def start(self, spec: SandboxSpec) -> BackendState:
        """Start the isolated environment and its first process (phase compute)."""
        ...

    async def mount(self, spec: SandboxSpec, state: BackendState) -> BackendState:
        """Attach the chat's workspace at /workspace and verify it from inside (phase mount)."""
        ...

    async def probe(self, spec: SandboxSpec, state: BackendState) -> bool:
        """Run the readiness probe inside; False means "not yet", an error means failed."""
        ...

    async def exec(self, state: BackendState, request: ExecRequest) -> ExecResult: ...

    async def inspect(self, state: BackendState) -> Inspection: ...

    async def stop(self, state: BackendState) -> None:
        """Kill every process of the sandbox and release its resources; keep the workspace."""
        ...

    async def list_sandboxes(self) -> dict[str, BackendState]:
        """Sandboxes this backend finds running on its own (sandbox id → state)."""
        ...

    async def aclose(self) -> None: ...

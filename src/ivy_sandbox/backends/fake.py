"""A fake backend: runs nothing, only takes time and fails on request.

It is a test double. It ships for one purpose besides tests: ``IVY_SANDBOX_BACKEND=latency-fake``
lets benchmarks measure the control plane with injected, realistic phase times and no real
sandboxes. It must never be mistaken for isolation — ``exec`` runs nothing: it echoes the
command back (for API plumbing tests).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

from ivy_sandbox.backends.base import (
    BackendError,
    BackendState,
    EnforcedLimits,
    ErrorCode,
    ExecRequest,
    ExecResult,
    Inspection,
    Liveness,
    SandboxSpec,
)
from ivy_sandbox.domain.sandbox import Phase

FAIL_CODES = {
    Phase.COMPUTE: ErrorCode.COMPUTE_FAILED,
    Phase.MOUNT: ErrorCode.MOUNT_FAILED,
    Phase.READY: ErrorCode.READINESS_FAILED,
}


@dataclass
class FakeBackend:
    """Configurable test double. Delays are seconds; ``jitter`` multiplies them by U(1-j, 1+j)."""

    name: str = "fake"
    delays: dict[Phase, float] = field(default_factory=dict)
    jitter: float = 0.0
    fail_in: Phase | None = None
    hang_in: Phase | None = None
    never_ready: bool = False
    running: dict[str, BackendState] = field(default_factory=dict)
    stopped: list[str] = field(default_factory=list)
    calls: list[tuple[str, str]] = field(default_factory=list)
    exit_statuses: dict[str, int] = field(default_factory=dict)

    def enforced_limits(self) -> EnforcedLimits:
        return EnforcedLimits(memory="none (fake)", pids="none (fake)", cpu="none (fake)")

    async def _step(self, phase: Phase, sandbox_id: str) -> None:
        self.calls.append((phase.value, sandbox_id))
        if self.hang_in is phase:
            await asyncio.Event().wait()
        delay = self.delays.get(phase, 0.0)
        if self.jitter:
            delay *= random.uniform(1 - self.jitter, 1 + self.jitter)
        if delay > 0:
            await asyncio.sleep(delay)
        if self.fail_in is phase:
            raise BackendError(FAIL_CODES[phase], f"injected {phase.value} failure")

    async def start(self, spec: SandboxSpec) -> BackendState:
        await self._step(Phase.COMPUTE, spec.sandbox_id)
        state: BackendState = {"fake": spec.sandbox_id, "chat": spec.chat_id}
        self.running[spec.sandbox_id] = state
        return state

    async def mount(self, spec: SandboxSpec, state: BackendState) -> BackendState:
        await self._step(Phase.MOUNT, spec.sandbox_id)
        return state | {"mounted": True}

    async def probe(self, spec: SandboxSpec, state: BackendState) -> bool:  # noqa: ARG002
        await self._step(Phase.READY, spec.sandbox_id)
        return not self.never_ready

    async def exec(self, state: BackendState, request: ExecRequest) -> ExecResult:
        sandbox_id = str(state.get("fake"))
        if sandbox_id not in self.running:
            raise BackendError(ErrorCode.SANDBOX_EXITED, "the sandbox is not running")
        # Echo back what was asked, so API tests can check the plumbing; nothing runs.
        stdout = " ".join(request.command).encode()
        return ExecResult(
            exit_code=0, stdout=stdout, stderr=b"", duration_ms=0, truncated=False, timed_out=False
        )

    async def inspect(self, state: BackendState) -> Inspection:
        sandbox_id = str(state.get("fake"))
        if sandbox_id in self.running:
            return Inspection(Liveness.RUNNING)
        if sandbox_id in self.exit_statuses:
            return Inspection(Liveness.EXITED, self.exit_statuses[sandbox_id])
        return Inspection(Liveness.GONE)

    async def stop(self, state: BackendState) -> None:
        sandbox_id = str(state.get("fake"))
        if self.running.pop(sandbox_id, None) is not None:
            self.stopped.append(sandbox_id)

    async def list_sandboxes(self) -> dict[str, BackendState]:
        return dict(self.running)

    async def aclose(self) -> None:
        return None

    def kill(self, sandbox_id: str, exit_status: int) -> None:
        """Simulate the sandbox's processes dying on their own."""
        self.running.pop(sandbox_id, None)
        self.exit_statuses[sandbox_id] = exit_status


def latency_backend(**kwargs: Any) -> FakeBackend:
    """The benchmark backend: realistic phase times with spread, nothing runs."""
    delays = {Phase.COMPUTE: 1.5, Phase.MOUNT: 0.8, Phase.READY: 0.4}
    return FakeBackend(name="latency-fake", delays=delays, jitter=0.3, **kwargs)

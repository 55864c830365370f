"""Driving one launch through compute → mount → ready, under a lease, with watchdogs.

Every database write is fenced by the lease (see :mod:`ivy_sandbox.storage.sandboxes`): if a
write reports that the sandbox moved on (stopped, relaunched, taken over), the driver stops
whatever it started and lets go. Each phase has its own timeout; a timeout or a backend error
fails the sandbox with a stable ``errorCode`` and a message that names the phase and cause.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import TypeVar

from ivy_sandbox.aio import wait_event
from ivy_sandbox.backends.base import (
    BackendError,
    BackendState,
    ErrorCode,
    Liveness,
    ResourceLimits,
    SandboxBackend,
    SandboxSpec,
)
from ivy_sandbox.domain.eta import PhaseStat, seconds_until_ready
from ivy_sandbox.domain.sandbox import Phase, SandboxStatus
from ivy_sandbox.metrics import LAUNCHES, PHASE_DURATION
from ivy_sandbox.services.clock import Clock
from ivy_sandbox.storage.sandboxes import SandboxRecord, SandboxRepository

log = logging.getLogger(__name__)
T = TypeVar("T")

PROBE_INTERVAL = 0.05
CAPACITY_POLL = 0.25


@dataclass(frozen=True)
class EngineSettings:
    max_sandboxes: int = 50
    capacity_timeout: float = 300.0
    compute_timeout: float = 60.0
    mount_timeout: float = 30.0
    ready_timeout: float = 30.0
    idle_timeout: float = 900.0
    lease_ttl: float = 15.0
    network: bool = False
    limits: ResourceLimits = field(default_factory=ResourceLimits)


class LeaseLost(Exception):
    """The sandbox is no longer ours to drive (stopped, relaunched or taken over)."""


class PhaseFailed(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


TIMEOUT_CODES = {
    Phase.COMPUTE: ErrorCode.COMPUTE_TIMEOUT,
    Phase.MOUNT: ErrorCode.MOUNT_TIMEOUT,
    Phase.READY: ErrorCode.READINESS_TIMEOUT,
}
PHASE_WORDS = {
    Phase.COMPUTE: "starting compute",
    Phase.MOUNT: "mounting the workspace",
    Phase.READY: "the readiness probe",
}


class LaunchDriver:
    """Drives one claimed sandbox to active or failed. One instance per launch."""

    def __init__(
        self,
        record: SandboxRecord,
        owner: str,
        *,
        sandboxes: SandboxRepository,
        backend: SandboxBackend,
        clock: Clock,
        settings: EngineSettings,
        capacity_freed: asyncio.Event,
    ) -> None:
        self.record = record
        self.owner = owner
        self.sandboxes = sandboxes
        self.backend = backend
        self.clock = clock
        self.settings = settings
        self.capacity_freed = capacity_freed
        self.state: BackendState = dict(record.backend_state)
        self.stats: dict[Phase, PhaseStat] = {}
        self.spec = SandboxSpec(
            sandbox_id=record.id,
            chat_id=record.chat_id,
            network=settings.network,
            limits=settings.limits,
        )

    async def run(self) -> None:
        renewer = asyncio.create_task(self._renew_lease())
        try:
            await self._drive()
        except LeaseLost:
            log.info("sandbox %s moved on while provisioning; cleaning up", self.record.id)
            await self._cleanup()
        except PhaseFailed as failure:
            await self._fail(failure.code, failure.message)
        except BackendError as error:
            await self._fail(error.code, f"{self.record.phase.value}: {error.message}")
        except Exception:
            # A bug must not leave the sandbox provisioning forever (nor crash the worker).
            log.exception("unexpected error while provisioning %s", self.record.id)
            await self._fail(
                ErrorCode.INTERNAL_ERROR,
                f"{self.record.phase.value}: unexpected error in the {self.backend.name} "
                "backend; the server log has the details",
            )
        finally:
            renewer.cancel()
            await self.sandboxes.release(self.record.id, self.owner)

    async def _drive(self) -> None:
        self.stats = await self.sandboxes.phase_stats(self.backend.name)
        if self.record.phase is Phase.COMPUTE:
            await self._admit()
            await self._start_compute()
            await self._enter(Phase.MOUNT, save_state=True)
        if self.record.phase is Phase.MOUNT:
            self.state = await self._within(Phase.MOUNT, self.backend.mount(self.spec, self.state))
            await self._enter(Phase.READY, save_state=True)
        if self.record.phase is Phase.READY:
            await self._within(Phase.READY, self._probe_until_ready())
            await self._enter(Phase.READY, SandboxStatus.ACTIVE)
            LAUNCHES.labels("active", "").inc()
            log.info("sandbox %s active", self.record.id)

    async def _admit(self) -> None:
        if self.record.admitted_at is not None:
            return
        deadline = asyncio.get_running_loop().time() + self.settings.capacity_timeout
        announced_wait = False
        while True:
            now = self.clock.now()
            eta = seconds_until_ready(self.backend.name, Phase.COMPUTE, self.stats)
            if await self.sandboxes.admit(
                self.record, self.owner, now, self.settings.max_sandboxes, eta
            ):
                # The next launch in line may have been waiting only for this one (FIFO):
                # wake the waiters now rather than at their next poll.
                self.capacity_freed.set()
                self.record = replace(
                    self.record, admitted_at=now, phase_started_at=now, eta_seconds=eta
                )
                return
            if not announced_wait:  # queued: the ETA is unknown until a slot frees
                if not await self.sandboxes.mark_queued(self.record, self.owner, now):
                    raise LeaseLost
                announced_wait = True
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                raise PhaseFailed(
                    ErrorCode.CAPACITY_TIMEOUT,
                    f"compute: no sandbox capacity became free within "
                    f"{self.settings.capacity_timeout:g} s (IVY_MAX_SANDBOXES="
                    f"{self.settings.max_sandboxes})",
                )
            self.capacity_freed.clear()
            await wait_event(self.capacity_freed, min(CAPACITY_POLL, remaining))

    async def _start_compute(self) -> None:
        if self.state:
            # Resuming after a crash: keep the process if it is still there.
            inspection = await self.backend.inspect(self.state)
            if inspection.liveness is Liveness.RUNNING:
                return
            await self.backend.stop(self.state)
            self.state = {}
        # Saved with the move to mount, right after (no await in between but that write):
        # a crash before it leaves a process that the orphan sweep stops.
        self.state = await self._within(Phase.COMPUTE, self.backend.start(self.spec))

    async def _probe_until_ready(self) -> None:
        while not await self.backend.probe(self.spec, self.state):  # noqa: ASYNC110 - polling a probe
            await asyncio.sleep(PROBE_INTERVAL)

    async def _within(self, phase: Phase, step: Awaitable[T]) -> T:
        limit = {
            Phase.COMPUTE: self.settings.compute_timeout,
            Phase.MOUNT: self.settings.mount_timeout,
            Phase.READY: self.settings.ready_timeout,
        }[phase]
        try:
            return await asyncio.wait_for(step, limit)
        except TimeoutError:
            raise PhaseFailed(
                TIMEOUT_CODES[phase],
                f"{phase.value}: {PHASE_WORDS[phase]} did not finish within {limit:g} s",
            ) from None

    async def _enter(
        self,
        phase: Phase,
        status: SandboxStatus = SandboxStatus.PROVISIONING,
        *,
        save_state: bool = False,
    ) -> None:
        """Move to ``phase`` and record how long the finished one took: one transaction."""
        now = self.clock.now()
        finished = self.record.phase
        took = max(0.0, (now - self.record.phase_started_at).total_seconds())
        PHASE_DURATION.labels(self.backend.name, finished.value).observe(took)
        eta = (
            None
            if status is SandboxStatus.ACTIVE
            else seconds_until_ready(self.backend.name, phase, self.stats)
        )
        moved, self.stats[finished] = await self.sandboxes.transition(
            self.record,
            self.owner,
            phase=phase,
            now=now,
            eta_seconds=eta,
            backend=self.backend.name,
            finished_seconds=took,
            status=status,
            backend_state=self.state if save_state else None,
        )
        if moved is None:
            raise LeaseLost
        self.record = moved

    async def _renew_lease(self) -> None:
        ttl = timedelta(seconds=self.settings.lease_ttl)
        while True:
            await asyncio.sleep(self.settings.lease_ttl / 3)
            if not await self.sandboxes.renew(self.record.id, self.owner, self.clock.now(), ttl):
                return  # the next fenced write notices and cleans up

    async def _fail(self, code: ErrorCode, message: str) -> None:
        log.warning("sandbox %s failed: %s (%s)", self.record.id, message, code)
        LAUNCHES.labels("failed", code.value).inc()
        await self.sandboxes.fail(
            self.record.id, code.value, message, self.clock.now(), owner=self.owner
        )
        await self._cleanup()

    async def _cleanup(self) -> None:
        if self.state:
            try:
                await self.backend.stop(self.state)
            except Exception:
                log.exception(
                    "could not stop sandbox %s; the orphan sweep will retry", self.record.id
                )
        self.capacity_freed.set()

"""The provisioning worker: claims launches, watches running sandboxes, reconciles.

Runs inside ``serve`` by default and as ``ivy-sandbox worker`` on its own; any number may
run against one database. Launches are claimed through leases (one driver per sandbox);
the watch over active sandboxes and the orphan sweep are idempotent, so several workers
doing them at once is harmless.

On start it reconciles: leases of dead workers on this host are released (their launches
resume at once instead of after the lease expires), active sandboxes whose processes are
gone become ``failed``, and sandboxes the backend runs without a live record are stopped.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import secrets
import socket
from datetime import datetime, timedelta

from ivy_sandbox.aio import wait_event
from ivy_sandbox.backends.base import ErrorCode, Liveness, SandboxBackend
from ivy_sandbox.domain.sandbox import SandboxStatus
from ivy_sandbox.services.clock import Clock
from ivy_sandbox.storage.sandboxes import ActiveSandbox, SandboxRepository
from ivy_sandbox.workers.steps import EngineSettings, LaunchDriver

log = logging.getLogger(__name__)


def new_owner_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def dead_owners_on_this_host(owners: set[str], me: str) -> list[str]:
    """Lease owners (``host:pid:nonce``) that are certainly gone: same host, pid not alive,
    or our own pid with another nonce (an earlier incarnation of this process id)."""
    host, pid, _ = me.split(":", 2)
    dead = []
    for owner in owners:
        parts = owner.split(":")
        if len(parts) != 3 or parts[0] != host or owner == me or not parts[1].isdigit():
            continue
        if parts[1] == pid or not _pid_alive(int(parts[1])):
            dead.append(owner)
    return dead


class Provisioner:
    def __init__(
        self,
        sandboxes: SandboxRepository,
        backend: SandboxBackend,
        clock: Clock,
        settings: EngineSettings,
        *,
        poll_interval: float = 1.0,
        monitor_interval: float = 1.0,
        sweep_interval: float = 30.0,
        max_concurrent: int = 64,
    ) -> None:
        self.sandboxes = sandboxes
        self.backend = backend
        self.clock = clock
        self.settings = settings
        self.owner = new_owner_id()
        self.poll_interval = poll_interval
        self.monitor_interval = monitor_interval
        self.sweep_interval = sweep_interval
        self.max_concurrent = max_concurrent
        self._wake = asyncio.Event()
        self._capacity_freed = asyncio.Event()
        self._drivers: dict[str, asyncio.Task[None]] = {}
        self._loops: list[asyncio.Task[None]] = []

    def kick(self) -> None:
        """A launch was recorded: look for work now instead of at the next poll."""
        self._wake.set()

    async def start(self) -> None:
        await self.reconcile()
        self._loops = [
            asyncio.create_task(self._claim_loop(), name="ivy-claim"),
            asyncio.create_task(self._watch_loop(), name="ivy-watch"),
        ]

    async def aclose(self) -> None:
        """Stop driving. Sandboxes stay as they are; leases are released for the next worker."""
        pending = {*self._loops, *self._drivers.values()}
        while pending:
            # Again and again: a task that swallowed one cancellation (see aio.wait_event)
            # must not keep shutdown waiting forever.
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=1.0)
        self._loops.clear()
        self._drivers.clear()

    async def run_forever(self) -> None:
        await self.start()
        try:
            await asyncio.gather(*self._loops)
        finally:
            await self.aclose()

    # -- reconcile -----------------------------------------------------------------------
    async def reconcile(self) -> None:
        held = await self.sandboxes.leases_held()
        dead = dead_owners_on_this_host(set(held.values()), self.owner)
        if dead:
            freed = await self.sandboxes.release_leases(dead)
            log.info("released %d launch lease(s) of %d dead worker(s)", freed, len(dead))
        await self.check_active()
        await self.sweep_orphans()

    async def check_active(self) -> None:
        """Fail sandboxes whose processes died; stop those idle for too long."""
        now = self.clock.now()
        idle_before = now - timedelta(seconds=self.settings.idle_timeout)
        async for page in self.sandboxes.active_pages():
            for record in page:
                try:
                    await self._check_one(record, idle_before)
                except Exception:
                    log.exception("checking sandbox %s failed; will retry", record.id)
                # An inspection rarely awaits anything real, so without this the sweep runs
                # as one slice of the loop: with 500 sandboxes, a stall of tens of ms once a
                # second that every request in flight waits out (the density p99).
                await asyncio.sleep(0)

    async def _check_one(self, record: ActiveSandbox, idle_before: datetime) -> None:
        inspection = await self.backend.inspect(record.backend_state)
        if inspection.liveness is not Liveness.RUNNING:
            status = inspection.exit_status
            cause = f"with status {status}" if status is not None else "(exit status unknown)"
            message = f"The sandbox's process exited {cause}."
            if inspection.detail:
                message += f" {inspection.detail}"
            failed = await self.sandboxes.fail(
                record.id,
                ErrorCode.SANDBOX_EXITED.value,
                message,
                self.clock.now(),
                from_status=SandboxStatus.ACTIVE,
            )
            if failed is not None:
                log.warning("sandbox %s exited: %s", record.id, message)
                await self.backend.stop(record.backend_state)
                self._capacity_freed.set()
            return
        last = record.last_activity_at
        if last < idle_before and await self.sandboxes.remove_by_id(record, SandboxStatus.ACTIVE):
            log.info("sandbox %s idle since %s: stopped", record.id, last.isoformat())
            await self.backend.stop(record.backend_state)
            self._capacity_freed.set()

    async def sweep_orphans(self) -> None:
        """Stop what the backend runs that no provisioning or active record accounts for."""
        running = await self.backend.list_sandboxes()
        if not running:
            return
        live = await self.sandboxes.ids_with_status(
            SandboxStatus.PROVISIONING, SandboxStatus.ACTIVE
        )
        for sandbox_id, state in running.items():
            if sandbox_id not in live:
                log.warning("stopping orphan sandbox %s (no live record)", sandbox_id)
                await self.backend.stop(state)
                self._capacity_freed.set()

    # -- loops ---------------------------------------------------------------------------
    async def _claim_loop(self) -> None:
        while True:
            try:
                await self.claim_available()
            except Exception:
                log.exception("claiming launches failed; retrying")
            self._wake.clear()
            await wait_event(self._wake, self.poll_interval)

    async def claim_available(self) -> int:
        free = self.max_concurrent - len(self._drivers)
        if free <= 0:
            return 0
        now = self.clock.now()
        ttl = timedelta(seconds=self.settings.lease_ttl)
        claimed = 0
        for sandbox_id in await self.sandboxes.claimable(now, free + len(self._drivers)):
            if sandbox_id in self._drivers or claimed >= free:
                continue
            if not await self.sandboxes.claim(sandbox_id, self.owner, now, ttl):
                continue
            record = await self.sandboxes.by_id(sandbox_id)
            if record is None or record.status is not SandboxStatus.PROVISIONING:
                continue
            driver = LaunchDriver(
                record,
                self.owner,
                sandboxes=self.sandboxes,
                backend=self.backend,
                clock=self.clock,
                settings=self.settings,
                capacity_freed=self._capacity_freed,
            )
            task = asyncio.create_task(driver.run(), name=f"ivy-launch-{sandbox_id}")
            self._drivers[sandbox_id] = task
            task.add_done_callback(functools.partial(self._driver_done, sandbox_id))
            claimed += 1
        return claimed

    def _driver_done(self, sandbox_id: str, _task: asyncio.Task[None]) -> None:
        self._drivers.pop(sandbox_id, None)
        self._wake.set()  # a slot in this worker freed up

    async def _watch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_sweep = loop.time() + self.sweep_interval
        while True:
            await asyncio.sleep(self.monitor_interval)
            try:
                await self.check_active()
                if loop.time() >= next_sweep:
                    next_sweep = loop.time() + self.sweep_interval
                    await self.sweep_orphans()
            except Exception:
                log.exception("watching sandboxes failed; retrying")

    async def wait_idle(self) -> None:
        """Wait until no launch is being driven (for tests and graceful shutdown)."""
        while self._drivers:
            await asyncio.gather(*self._drivers.values(), return_exceptions=True)

"""Reconciliation on worker start: dead leases, dead sandboxes, orphans, resumed launches."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from conftest import World
from fakes import WallClock
from ivy_sandbox.backends.fake import FakeBackend
from ivy_sandbox.domain.sandbox import Phase, SandboxStatus
from ivy_sandbox.storage.repository import Repository
from ivy_sandbox.storage.sandboxes import SandboxRepository
from ivy_sandbox.workers.provisioner import Provisioner, dead_owners_on_this_host
from ivy_sandbox.workers.steps import EngineSettings

FAR = 3600.0


@pytest.fixture
def clock() -> WallClock:  # type: ignore[override]
    return WallClock()


def worker(repository: Repository, backend: FakeBackend, clock: WallClock) -> Provisioner:
    return Provisioner(
        SandboxRepository(repository.engine),
        backend,
        clock,
        EngineSettings(lease_ttl=3),
        poll_interval=0.02,
        monitor_interval=0.05,
    )


async def settle(repo: SandboxRepository, chat: str, wanted: SandboxStatus) -> Any:
    for _ in range(300):
        record = await repo.by_chat(chat)
        if record is not None and record.status is wanted:
            return record
        await asyncio.sleep(0.01)
    raise AssertionError(f"{chat} never became {wanted}: {await repo.by_chat(chat)}")


async def test_a_launch_leased_by_a_dead_worker_on_this_host_resumes_at_once(
    world: World, repository: Repository, clock: WallClock
) -> None:
    chat = await world.chat()
    dead_owner = f"{socket.gethostname()}:999999:dead"
    future = clock.now().replace(year=clock.now().year + 1)
    await world.sandbox(
        chat, "provisioning", "compute", lease_owner=dead_owner, lease_expires_at=future
    )
    backend = FakeBackend()
    provisioner = worker(repository, backend, clock)
    await provisioner.start()
    try:
        record = await settle(SandboxRepository(repository.engine), chat, SandboxStatus.ACTIVE)
        assert record.lease_owner is None
    finally:
        await provisioner.aclose()


async def test_a_live_lease_from_another_host_is_respected(
    world: World, repository: Repository, clock: WallClock
) -> None:
    chat = await world.chat()
    future = clock.now().replace(year=clock.now().year + 1)
    await world.sandbox(
        chat, "provisioning", "compute", lease_owner="other-host:1:x", lease_expires_at=future
    )
    provisioner = worker(repository, FakeBackend(), clock)
    await provisioner.start()
    try:
        await asyncio.sleep(0.2)
        record = await SandboxRepository(repository.engine).by_chat(chat)
        assert record is not None
        assert (record.status, record.lease_owner) == (SandboxStatus.PROVISIONING, "other-host:1:x")
    finally:
        await provisioner.aclose()


async def test_an_active_sandbox_whose_process_is_gone_is_failed_on_start(
    world: World, repository: Repository, clock: WallClock
) -> None:
    chat = await world.chat()
    await world.sandbox(chat, "active", "ready", backend_state={"fake": "sbx_gone"})
    provisioner = worker(repository, FakeBackend(), clock)
    await provisioner.reconcile()
    record = await SandboxRepository(repository.engine).by_chat(chat)
    assert record is not None
    assert record.status is SandboxStatus.FAILED
    assert record.error_code == "sandbox_exited"
    assert "exit status unknown" in (record.error_message or "")


async def test_a_running_active_sandbox_is_adopted_untouched(
    world: World, repository: Repository, clock: WallClock
) -> None:
    chat = await world.chat()
    backend = FakeBackend()
    backend.running["sbx_alive"] = {"fake": "sbx_alive"}
    await world.sandbox(
        chat, "active", "ready", id="sbx_alive", backend_state={"fake": "sbx_alive"}
    )
    await worker(repository, backend, clock).reconcile()
    record = await SandboxRepository(repository.engine).by_chat(chat)
    assert record is not None
    assert record.status is SandboxStatus.ACTIVE
    assert "sbx_alive" in backend.running


async def test_sandboxes_without_a_live_record_are_stopped(
    world: World, repository: Repository, clock: WallClock
) -> None:
    chat = await world.chat()
    backend = FakeBackend()
    backend.running["sbx_orphan"] = {"fake": "sbx_orphan"}
    backend.running["sbx_failed"] = {"fake": "sbx_failed"}
    await world.sandbox(
        chat, "failed", "failed", id="sbx_failed", backend_state={"fake": "sbx_failed"}
    )
    await worker(repository, backend, clock).reconcile()
    assert backend.running == {}
    assert sorted(backend.stopped) == ["sbx_failed", "sbx_orphan"]


async def test_a_launch_resumed_in_mount_keeps_its_running_process(
    world: World, repository: Repository, clock: WallClock
) -> None:
    chat = await world.chat()
    backend = FakeBackend()
    backend.running["sbx_mid"] = {"fake": "sbx_mid"}
    await world.sandbox(
        chat,
        "provisioning",
        "mount",
        id="sbx_mid",
        backend_state={"fake": "sbx_mid"},
        admitted_at=clock.now(),
    )
    provisioner = worker(repository, backend, clock)
    await provisioner.start()
    try:
        await settle(SandboxRepository(repository.engine), chat, SandboxStatus.ACTIVE)
    finally:
        await provisioner.aclose()
    assert [c for c in backend.calls if c[0] == "compute"] == []  # not started twice
    assert ("mount", "sbx_mid") in backend.calls


async def test_a_launch_resumed_in_compute_restarts_a_dead_process(
    world: World, repository: Repository, clock: WallClock
) -> None:
    chat = await world.chat()
    backend = FakeBackend()
    await world.sandbox(
        chat,
        "provisioning",
        "compute",
        id="sbx_dead",
        backend_state={"fake": "sbx_dead"},
        admitted_at=clock.now(),
    )
    provisioner = worker(repository, backend, clock)
    await provisioner.start()
    try:
        await settle(SandboxRepository(repository.engine), chat, SandboxStatus.ACTIVE)
    finally:
        await provisioner.aclose()
    assert ("compute", "sbx_dead") in backend.calls


def test_dead_owner_detection_only_trusts_this_host() -> None:
    me = f"{socket.gethostname()}:12345:aaaa"
    owners = {
        f"{socket.gethostname()}:999999:x",  # dead pid here
        f"{socket.gethostname()}:12345:bbbb",  # an earlier process with our pid
        f"{socket.gethostname()}:1:x",  # pid 1 is alive
        "elsewhere:999999:x",  # another host: cannot know
        "garbage",
        me,
    }
    assert sorted(dead_owners_on_this_host(owners, me)) == sorted(
        [f"{socket.gethostname()}:999999:x", f"{socket.gethostname()}:12345:bbbb"]
    )


def test_phase_enum_of_timeline_matches_launch_phases() -> None:
    assert [p.value for p in (Phase.COMPUTE, Phase.MOUNT, Phase.READY)] == [
        "compute",
        "mount",
        "ready",
    ]

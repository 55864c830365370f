"""Admission against IVY_MAX_SANDBOXES (one fenced UPDATE); paging sandboxes by status."""

from __future__ import annotations

from datetime import timedelta

from conftest import World
from fakes import FakeClock
from ivy_sandbox.domain.sandbox import SandboxStatus
from ivy_sandbox.events import LocalEventBus
from ivy_sandbox.storage.repository import Repository
from ivy_sandbox.storage.sandboxes import SandboxRecord, SandboxRepository

OWNER = "worker-test"


async def waiting_launches(
    world: World, clock: FakeClock, store: SandboxRepository, count: int
) -> list[SandboxRecord]:
    """``count`` claimed, not yet admitted launches, oldest first."""
    records = []
    for _ in range(count):
        chat = await world.chat()
        await world.sandbox(chat, "provisioning", "compute")
        clock.advance(1)
    for record in sorted(
        [r for r in await store.with_status(SandboxStatus.PROVISIONING) if r.admitted_at is None],
        key=lambda r: r.created_at,
    ):
        assert await store.claim(record.id, OWNER, clock.now(), timedelta(seconds=30))
        records.append(record)
    return records


async def test_launches_arriving_together_below_capacity_are_all_admitted_at_first_try(
    repository: Repository, world: World, clock: FakeClock
) -> None:
    store = SandboxRepository(repository.engine, LocalEventBus())
    launches = await waiting_launches(world, clock, store, 4)
    # Youngest first: each still has room for itself and every older waiter.
    for record in reversed(launches):
        assert await store.admit(record, OWNER, clock.now(), capacity=4, eta_seconds=1.0)


async def test_a_younger_launch_never_takes_a_slot_an_older_waiter_needs(
    repository: Repository, world: World, clock: FakeClock
) -> None:
    store = SandboxRepository(repository.engine, LocalEventBus())
    oldest, middle, youngest = await waiting_launches(world, clock, store, 3)
    now = clock.now()
    assert not await store.admit(youngest, OWNER, now, capacity=2, eta_seconds=None)
    assert await store.admit(middle, OWNER, now, capacity=2, eta_seconds=None)
    assert await store.admit(oldest, OWNER, now, capacity=2, eta_seconds=None)
    assert not await store.admit(youngest, OWNER, now, capacity=2, eta_seconds=None)  # full


async def test_pages_with_status_yield_every_sandbox_once_in_bounded_pages(
    repository: Repository, world: World
) -> None:
    store = SandboxRepository(repository.engine, LocalEventBus())
    for _ in range(7):
        await world.sandbox(await world.chat(), "active", "ready")
    await world.sandbox(await world.chat(), "failed", "failed")
    pages = [page async for page in store.pages_with_status(SandboxStatus.ACTIVE, page_size=3)]
    assert [len(page) for page in pages] == [3, 3, 1]
    ids = [record.id for page in pages for record in page]
    assert len(set(ids)) == 7
    assert all(record.status is SandboxStatus.ACTIVE for page in pages for record in page)

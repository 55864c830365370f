"""Admission against IVY_MAX_SANDBOXES (one fenced UPDATE); paging the active sandboxes."""

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


async def test_active_pages_yield_every_active_sandbox_once_in_bounded_pages(
    repository: Repository, world: World
) -> None:
    store = SandboxRepository(repository.engine, LocalEventBus())
    for _ in range(7):
        await world.sandbox(await world.chat(), "active", "ready")
    await world.sandbox(await world.chat(), "failed", "failed")
    await world.sandbox(await world.chat(), "provisioning", "compute")
    pages = [page async for page in store.active_pages(page_size=3)]
    assert [len(page) for page in pages] == [3, 3, 1]
    ids = [record.id for page in pages for record in page]
    assert len(set(ids)) == 7
    active = {r.id for r in await store.with_status(SandboxStatus.ACTIVE)}
    assert set(ids) == active


async def test_active_pages_give_the_last_activity_else_ready_else_created_time(
    repository: Repository, world: World, clock: FakeClock
) -> None:
    store = SandboxRepository(repository.engine, LocalEventBus())
    created = clock.now()
    ready, touched = created + timedelta(seconds=3), created + timedelta(seconds=50)
    state = {"sandbox_id": "sbx_x", "pids": {"command": [12, 34]}}
    chats = [await world.chat() for _ in range(3)]
    await world.sandbox(chats[0], "active", "ready", ready_at=ready, last_activity_at=touched)
    await world.sandbox(chats[1], "active", "ready", ready_at=ready, backend_state=state)
    await world.sandbox(chats[2], "active", "ready")
    found = {r.chat_id: r for page in [p async for p in store.active_pages()] for r in page}
    assert [found[chat].last_activity_at for chat in chats] == [touched, ready, created]
    assert all(found[chat].last_activity_at.tzinfo is not None for chat in chats)
    assert found[chats[1]].backend_state == state
    assert found[chats[0]].backend_state == {}


async def test_ids_with_status_are_exactly_the_ids_in_those_statuses(
    repository: Repository, world: World
) -> None:
    store = SandboxRepository(repository.engine, LocalEventBus())
    for status, phase in (("active", "ready"), ("provisioning", "compute"), ("failed", "failed")):
        await world.sandbox(await world.chat(), status, phase)
    live = await store.ids_with_status(SandboxStatus.PROVISIONING, SandboxStatus.ACTIVE)
    expected = {
        r.id for r in await store.with_status(SandboxStatus.PROVISIONING, SandboxStatus.ACTIVE)
    }
    assert live == expected
    assert len(live) == 2

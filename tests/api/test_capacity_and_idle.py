"""Admission against IVY_MAX_SANDBOXES (FIFO queue in compute) and idle reaping."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from conftest import World
from fakes import WallClock
from ivy_sandbox.backends.fake import FakeBackend
from ivy_sandbox.domain.sandbox import Phase
from ivy_sandbox.workers.steps import EngineSettings

pytestmark = pytest.mark.usefixtures("worker")
IDLE = 0.5


@pytest.fixture
def clock() -> WallClock:  # type: ignore[override]
    return WallClock()


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend(delays={Phase.COMPUTE: 0.02})


@pytest.fixture
def engine_settings() -> EngineSettings:  # type: ignore[override]
    return EngineSettings(
        max_sandboxes=1,
        capacity_timeout=2,
        compute_timeout=2,
        mount_timeout=2,
        ready_timeout=2,
        idle_timeout=IDLE,
        lease_ttl=3,
    )


async def status(client: httpx.AsyncClient, key: str, chat: str, suffix: str = "/status") -> Any:
    return (await client.get(f"/v1/sandbox/{chat}{suffix}", headers={"X-Ivy-Api-Key": key})).json()


async def until(
    client: httpx.AsyncClient, key: str, chat: str, wanted: str, within: float = 4.0
) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while (await status(client, key, chat))["status"] != wanted:
        assert asyncio.get_running_loop().time() < deadline, f"{chat} never became {wanted}"
        await asyncio.sleep(0.01)


async def test_launch_over_capacity_waits_in_compute_in_order_and_says_so(
    client: httpx.AsyncClient, world: World
) -> None:
    key = await world.key()
    first, second, third = [await world.chat() for _ in range(3)]
    for chat in (first, second, third):
        await client.post(f"/v1/sandbox/{chat}", headers={"X-Ivy-Api-Key": key})
    await until(client, key, first, "active")
    await asyncio.sleep(0.1)
    waiting = await status(client, key, second, "")
    assert (waiting["status"], waiting["phase"]) == ("provisioning", "compute")
    assert waiting["waiting"] == {"reason": "capacity", "queuePosition": 1}
    assert "etaSeconds" not in waiting  # unknown while queued
    assert (await status(client, key, third, ""))["waiting"]["queuePosition"] == 2
    # Keep the first busy so it is not reaped, then free its slot: the queue moves in order.
    await client.delete(f"/v1/sandbox/{first}", headers={"X-Ivy-Api-Key": key})
    await until(client, key, second, "active")
    assert (await status(client, key, third, ""))["waiting"]["queuePosition"] == 1


async def test_a_launch_that_never_gets_capacity_fails_with_capacity_timeout(
    client: httpx.AsyncClient, world: World
) -> None:
    key = await world.key()
    busy, starved = await world.chat(), await world.chat()
    await client.post(f"/v1/sandbox/{busy}", headers={"X-Ivy-Api-Key": key})
    await until(client, key, busy, "active")
    await client.post(f"/v1/sandbox/{starved}", headers={"X-Ivy-Api-Key": key})
    for _ in range(6):  # keep the busy one alive past the 2 s capacity timeout
        await client.post(f"/v1/sandbox/{busy}/keepalive", headers={"X-Ivy-Api-Key": key})
        await asyncio.sleep(0.4)
    await until(client, key, starved, "failed")
    detail = await status(client, key, starved, "")
    assert detail["errorCode"] == "capacity_timeout"
    assert "IVY_MAX_SANDBOXES=1" in detail["errorMessage"]


async def test_an_idle_sandbox_is_stopped_and_activity_keeps_one_alive(
    client: httpx.AsyncClient, world: World, backend: FakeBackend
) -> None:
    key = await world.key()
    chat = await world.chat()
    headers = {"X-Ivy-Api-Key": key}
    await client.post(f"/v1/sandbox/{chat}", headers=headers)
    await until(client, key, chat, "active")
    for _ in range(4):  # exec and keep-alive count as activity; status polls do not
        assert (
            await client.post(
                f"/v1/sandbox/{chat}/exec", headers=headers, json={"command": ["true"]}
            )
        ).status_code == 200
        await asyncio.sleep(IDLE / 2)
        assert (await status(client, key, chat))["status"] == "active"
    await until(client, key, chat, "none", within=IDLE * 6)
    # The record goes first (a client sees "none"), then the worker stops the backend.
    for _ in range(200):
        if not backend.running:
            break
        await asyncio.sleep(0.01)
    assert backend.running == {}

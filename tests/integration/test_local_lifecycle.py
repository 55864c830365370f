"""The whole lifecycle with real bubblewrap sandboxes, through the HTTP API and a worker.

What a poller sees, exec, workspace persistence across stop/launch, isolation between chats,
a sandbox whose process dies, and two workers sharing the launches. Backend-level details
(limits, timeouts, escapes) are in tests/integration/test_local_backend.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import World, service_unavailable
from fakes import WallClock
from ivy_sandbox.backends.base import BackendError, BackendState, SandboxBackend, SandboxSpec
from ivy_sandbox.bootstrap import Services
from ivy_sandbox.workers.provisioner import Provisioner
from ivy_sandbox.workers.steps import EngineSettings

pytestmark = [pytest.mark.usefixtures("worker"), pytest.mark.both_loops]


@pytest.fixture
def clock() -> WallClock:  # type: ignore[override]
    return WallClock()


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[SandboxBackend]:  # type: ignore[override]
    from ivy_sandbox.backends.local import LocalBackend

    try:
        local = LocalBackend(tmp_path / "data")
    except BackendError as exc:
        service_unavailable(f"bubblewrap cannot run here: {exc.message}")
    yield local
    for state in (await local.list_sandboxes()).values():
        await local.stop(state)
    await local.aclose()


@pytest.fixture
def engine_settings() -> EngineSettings:  # type: ignore[override]
    return EngineSettings(compute_timeout=20, mount_timeout=20, ready_timeout=20, lease_ttl=5)


Api = Callable[..., Awaitable[httpx.Response]]


def api_for(client: httpx.AsyncClient, key: str) -> Api:
    async def call(method: str, chat: str, suffix: str = "", **kwargs: Any) -> httpx.Response:
        return await client.request(
            method, f"/v1/sandbox/{chat}{suffix}", headers={"X-Ivy-Api-Key": key}, **kwargs
        )

    return call


async def run(api: Api, chat: str, *command: str, **options: Any) -> dict[str, Any]:
    response = await api("POST", chat, "/exec", json={"command": list(command), **options})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def until_active(api: Api, chat: str) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []
    for _ in range(2000):
        body = (await api("GET", chat, "/status")).json()
        pair = (body["status"], body.get("phase", ""))
        if not seen or seen[-1] != pair:
            seen.append(pair)
        if body["status"] in ("active", "failed"):
            assert body["status"] == "active", body
            return seen
        await asyncio.sleep(0.005)
    raise AssertionError(f"never active: {seen}")


async def test_a_real_sandbox_launches_through_the_phases_and_runs_commands(
    client: httpx.AsyncClient, world: World
) -> None:
    api = api_for(client, await world.key())
    chat = await world.chat()
    assert (await api("POST", chat)).status_code == 202
    seen = await until_active(api, chat)
    assert seen[0] == ("provisioning", "compute")
    assert seen[-1] == ("active", "ready")
    order = [
        ("provisioning", "compute"),
        ("provisioning", "mount"),
        ("provisioning", "ready"),
        ("active", "ready"),
    ]
    assert [order.index(pair) for pair in seen] == sorted(order.index(pair) for pair in seen)
    listing = await run(api, chat, "ls", "-a", "/workspace")
    assert listing["exitCode"] == 0
    assert listing["timedOut"] is False
    echoed = await run(
        api, chat, "sh", "-c", "cat; echo $FOO; pwd", stdin="hi\n", env={"FOO": "bar"}, cwd="/tmp"
    )
    assert echoed["stdout"] == "hi\nbar\n/tmp\n"
    assert (await run(api, chat, "sh", "-c", "exit 7"))["exitCode"] == 7


async def test_the_workspace_survives_stop_and_relaunch(
    client: httpx.AsyncClient, world: World
) -> None:
    api = api_for(client, await world.key())
    chat = await world.chat()
    await api("POST", chat)
    await until_active(api, chat)
    assert (await run(api, chat, "sh", "-c", "echo kept > /workspace/note.txt"))["exitCode"] == 0
    assert (await api("DELETE", chat)).json() == {"status": "none"}
    await api("POST", chat)
    await until_active(api, chat)
    assert (await run(api, chat, "cat", "/workspace/note.txt"))["stdout"] == "kept\n"


async def test_one_chat_cannot_see_another_chats_workspace_processes_or_the_network(
    client: httpx.AsyncClient, world: World
) -> None:
    api = api_for(client, await world.key())
    alice, bob = await world.chat(), await world.chat()
    for chat in (alice, bob):
        await api("POST", chat)
    for chat in (alice, bob):
        await until_active(api, chat)
    marker = f"secret-{uuid.uuid4().hex}"
    await run(api, alice, "sh", "-c", f"echo {marker} > /workspace/private.txt")
    bob_view = await run(api, bob, "sh", "-c", "ls -a /workspace; cat /workspace/private.txt")
    assert "private.txt" not in bob_view["stdout"]
    assert bob_view["exitCode"] != 0
    # Everything bob can reach outside the read-only system dirs holds no trace of it.
    search = (
        f"grep -rl --exclude-dir=proc --exclude-dir=sys --exclude-dir=usr {marker} / 2>/dev/null"
    )
    found = await run(api, bob, "sh", "-c", f"{search} | head -1")
    assert found["stdout"] == ""
    procs = await run(api, bob, "sh", "-c", "ls /proc | grep -c '^[0-9]'")
    assert int(procs["stdout"]) < 10  # its own few processes, not the host's
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        probe = (
            "import socket,sys\n"
            f"s=socket.socket(); s.settimeout(2)\n"
            f"sys.exit(0 if s.connect_ex(('127.0.0.1',{port}))==0 else 3)"
        )
        connected = await run(api, bob, "python3", "-c", probe)
    assert connected["exitCode"] == 3


async def test_exec_timeout_kills_the_command_and_its_children(
    client: httpx.AsyncClient, world: World
) -> None:
    api = api_for(client, await world.key())
    chat = await world.chat()
    await api("POST", chat)
    await until_active(api, chat)
    script = "(setsid sleep 300 &) ; sleep 300 & echo started; wait"
    result = await run(api, chat, "sh", "-c", script, timeoutSeconds=0.5)
    assert result["timedOut"] is True
    assert result["exitCode"] == 137
    assert result["stdout"] == "started\n"
    listing = "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done"
    leftovers = await run(api, chat, "sh", "-c", f"{listing} | grep -c 'sleep 30[0]'")
    assert leftovers["stdout"].strip() == "0"  # not even the one that escaped with setsid


async def test_a_sandbox_killed_from_outside_becomes_failed_with_its_exit_status(
    client: httpx.AsyncClient, world: World, services: Services
) -> None:
    api = api_for(client, await world.key())
    chat = await world.chat()
    await api("POST", chat)
    await until_active(api, chat)
    record = await services.sandboxes.by_chat(chat)
    assert record is not None
    pids = [int(p) for p in _pids_in(record.backend_state)]
    assert pids
    for pid in pids:
        with __import__("contextlib").suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for _ in range(500):
        body = (await api("GET", chat, "/status")).json()
        if body["status"] == "failed":
            break
        await asyncio.sleep(0.01)
    assert body["status"] == "failed"
    assert (await api("GET", chat)).json()["errorCode"] == "sandbox_exited"


def _pids_in(state: Any) -> list[int]:
    """Every integer that looks like a pid in the backend's state (its shape is private)."""
    found: list[int] = []
    if isinstance(state, dict):
        for key, value in state.items():
            if "pid" in key and isinstance(value, int):
                found.append(value)
            else:
                found.extend(_pids_in(value))
    elif isinstance(state, list):
        for value in state:
            found.extend(_pids_in(value))
    return found


def record_starts(backend: SandboxBackend, worker: str, starts: list[tuple[str, str]]) -> None:
    """A spy on ``backend.start``: which worker started which sandbox (it still starts it)."""
    original = backend.start

    async def start(spec: SandboxSpec) -> BackendState:
        starts.append((worker, spec.sandbox_id))
        return await original(spec)

    backend.start = start  # type: ignore[method-assign]


async def test_two_workers_with_real_sandboxes_never_drive_the_same_one(
    client: httpx.AsyncClient,
    world: World,
    services: Services,
    backend: SandboxBackend,
    engine_settings: EngineSettings,
    tmp_path: Path,
) -> None:
    """A second worker (its own backend on the same data dir, as a separate `ivy-sandbox
    worker` process has) claims launches through the same leases: each sandbox is started
    once, by one worker, and each chat ends with exactly one running sandbox."""
    from ivy_sandbox.backends.local import LocalBackend

    other_backend = LocalBackend(tmp_path / "data")
    starts: list[tuple[str, str]] = []
    record_starts(backend, "first", starts)
    record_starts(other_backend, "second", starts)
    second = Provisioner(
        services.sandboxes,
        other_backend,
        services.clock,
        engine_settings,
        poll_interval=0.01,
        monitor_interval=0.05,
    )
    await second.start()
    try:
        api = api_for(client, await world.key())
        chats = [await world.chat() for _ in range(6)]
        for chat in chats:
            assert (await api("POST", chat)).status_code == 202
        for chat in chats:
            await until_active(api, chat)
        started = [sandbox for _, sandbox in starts]
        assert len(started) == len(set(started)) == len(chats), starts
        assert len(await backend.list_sandboxes()) == len(chats)
        for chat in chats:  # each one usable, whichever worker started it
            assert (await run(api, chat, "true"))["exitCode"] == 0
    finally:
        await second.aclose()
        await other_backend.aclose()

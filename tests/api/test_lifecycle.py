"""The launch lifecycle through the HTTP API, driven by a real worker over a fake backend.

The fake backend (a named test double) takes configurable time and fails on request, so
every path of the state machine is reachable quickly; real sandboxes are covered by
tests/integration/test_local_lifecycle.py.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from conftest import World
from fakes import WallClock
from ivy_sandbox.backends.fake import FakeBackend
from ivy_sandbox.bootstrap import Services
from ivy_sandbox.domain.eta import seconds_until_ready
from ivy_sandbox.domain.sandbox import Phase
from ivy_sandbox.workers.provisioner import Provisioner
from ivy_sandbox.workers.steps import EngineSettings

pytestmark = pytest.mark.usefixtures("worker")


@pytest.fixture
def clock() -> WallClock:  # type: ignore[override]
    return WallClock()


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend(delays={Phase.COMPUTE: 0.05, Phase.MOUNT: 0.05, Phase.READY: 0.05})


@pytest.fixture
async def chat_and_key(world: World) -> tuple[str, dict[str, str]]:
    return await world.chat(), {"X-Ivy-Api-Key": await world.key()}


Call = Callable[..., Awaitable[httpx.Response]]


@pytest.fixture
def api(client: httpx.AsyncClient, chat_and_key: tuple[str, dict[str, str]]) -> Call:
    chat, headers = chat_and_key

    async def call(method: str, suffix: str = "", **kwargs: Any) -> httpx.Response:
        return await client.request(
            method, f"/v1/sandbox/{chat}{suffix}", headers=headers, **kwargs
        )

    return call


async def wait_for(
    api: Call, predicate: Callable[[dict[str, Any]], bool], within: float = 5.0
) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + within
    while True:
        body = (await api("GET", "/status")).json()
        if predicate(body):
            return body
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out; last status {body}")
        await asyncio.sleep(0.01)


async def test_a_poller_sees_compute_mount_ready_then_active(api: Call) -> None:
    assert (await api("GET", "/status")).json() == {"status": "none"}
    launched = await api("POST")
    assert launched.status_code == 202
    first = launched.json()
    assert (first["status"], first["phase"]) == ("provisioning", "compute")
    assert isinstance(first["etaSeconds"], int)
    seen: list[tuple[str, str]] = []
    while not seen or seen[-1][0] != "active":
        body = (await api("GET", "/status")).json()
        pair = (body["status"], body["phase"])
        if not seen or seen[-1] != pair:
            seen.append(pair)
        assert body["createdAt"] == first["createdAt"]
        await asyncio.sleep(0.005)
    assert seen == [
        ("provisioning", "compute"),
        ("provisioning", "mount"),
        ("provisioning", "ready"),
        ("active", "ready"),
    ]


async def test_launch_is_idempotent_while_provisioning_and_active(api: Call) -> None:
    first = (await api("POST")).json()
    again = (await api("POST")).json()
    assert again["createdAt"] == first["createdAt"]
    await wait_for(api, lambda b: b["status"] == "active")
    active = await api("POST")
    assert active.status_code == 202
    assert active.json()["status"] == "active"
    assert active.json()["createdAt"] == first["createdAt"]


async def test_launch_after_failed_starts_a_new_sandbox(api: Call, backend: FakeBackend) -> None:
    backend.fail_in = Phase.MOUNT
    await api("POST")
    failed = await wait_for(api, lambda b: b["status"] == "failed")
    first_id = (await api("GET")).json()["sandboxId"]
    backend.fail_in = None
    relaunched = (await api("POST")).json()
    assert relaunched["status"] == "provisioning"
    await wait_for(api, lambda b: b["status"] == "active")
    detail = (await api("GET")).json()
    assert detail["sandboxId"] != first_id
    assert detail["createdAt"] >= failed["createdAt"]


@pytest.mark.parametrize(
    ("phase", "code"),
    [
        (Phase.COMPUTE, "compute_failed"),
        (Phase.MOUNT, "mount_failed"),
        (Phase.READY, "readiness_failed"),
    ],
)
async def test_a_failure_in_each_phase_fails_with_its_code_and_names_the_phase(
    api: Call, backend: FakeBackend, phase: Phase, code: str
) -> None:
    backend.fail_in = phase
    await api("POST")
    body = await wait_for(api, lambda b: b["status"] == "failed")
    assert body["phase"] == "failed"
    assert "etaSeconds" not in body
    assert body["errorMessage"]
    detail = (await api("GET")).json()
    assert detail["errorCode"] == code
    assert backend.running == {}  # whatever started was stopped


@pytest.fixture
def engine_settings() -> EngineSettings:  # type: ignore[override]
    return EngineSettings(
        capacity_timeout=1, compute_timeout=0.3, mount_timeout=0.3, ready_timeout=0.3, lease_ttl=3
    )


@pytest.mark.parametrize(
    ("phase", "code", "word"),
    [
        (Phase.COMPUTE, "compute_timeout", "compute"),
        (Phase.MOUNT, "mount_timeout", "mount"),
        (Phase.READY, "readiness_timeout", "ready"),
    ],
)
async def test_a_hanging_phase_is_failed_by_its_watchdog(
    api: Call, backend: FakeBackend, phase: Phase, code: str, word: str
) -> None:
    backend.hang_in = phase
    await api("POST")
    body = await wait_for(api, lambda b: b["status"] == "failed")
    assert body["errorMessage"].startswith(f"{word}:")
    assert "0.3 s" in body["errorMessage"]
    assert (await api("GET")).json()["errorCode"] == code


async def test_a_probe_that_never_succeeds_times_out_as_readiness_timeout(
    api: Call, backend: FakeBackend
) -> None:
    backend.never_ready = True
    await api("POST")
    await wait_for(api, lambda b: b["status"] == "failed")
    assert (await api("GET")).json()["errorCode"] == "readiness_timeout"


async def test_stop_works_from_every_state_and_answers_none(
    api: Call, backend: FakeBackend
) -> None:
    assert (await api("DELETE")).json() == {"status": "none"}  # nothing to stop
    await api("POST")
    stopped = await api("DELETE")  # while provisioning
    assert (stopped.status_code, stopped.json()) == (200, {"status": "none"})
    await asyncio.sleep(0.3)
    assert (await api("GET", "/status")).json() == {"status": "none"}
    assert backend.running == {}  # the driver noticed and cleaned up
    await api("POST")
    await wait_for(api, lambda b: b["status"] == "active")
    assert (await api("DELETE")).json() == {"status": "none"}  # while active
    assert backend.running == {}
    backend.fail_in = Phase.COMPUTE
    await api("POST")
    await wait_for(api, lambda b: b["status"] == "failed")
    assert (await api("DELETE")).json() == {"status": "none"}  # after failure


async def test_a_sandbox_whose_process_dies_becomes_failed_with_its_exit_status(
    api: Call, backend: FakeBackend
) -> None:
    await api("POST")
    await wait_for(api, lambda b: b["status"] == "active")
    sandbox_id = (await api("GET")).json()["sandboxId"]
    backend.kill(sandbox_id, 137)
    body = await wait_for(api, lambda b: b["status"] == "failed", within=3)
    assert "137" in body["errorMessage"]
    assert (await api("GET")).json()["errorCode"] == "sandbox_exited"


async def test_exec_runs_only_in_an_active_sandbox(api: Call) -> None:
    refused = await api("POST", "/exec", json={"command": ["ls"]})
    assert refused.status_code == 409
    assert refused.json()["code"] == "conflict"
    await api("POST")
    await wait_for(api, lambda b: b["status"] == "active")
    ran = await api("POST", "/exec", json={"command": ["ls", "/workspace"]})
    assert ran.status_code == 200
    assert ran.json() == {
        "exitCode": 0,
        "stdout": "ls /workspace",  # the fake backend echoes; real runs are integration tests
        "stderr": "",
        "durationMs": 0,
        "truncated": False,
        "timedOut": False,
    }


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"command": []},
        {"command": "ls"},
        {"command": ["ls"], "timeoutSeconds": 0},
        {"command": ["ls"], "cwd": "relative"},
        {"command": ["ls"], "env": {"BAD NAME": "x"}},
        {"command": ["a\x00b"]},
        {"command": ["ls"], "unknown": 1},
    ],
)
async def test_invalid_exec_bodies_get_422_not_500(api: Call, body: dict[str, Any]) -> None:
    response = await api("POST", "/exec", json=body)
    assert response.status_code == 422
    assert response.json()["code"] == "invalid_request"


async def test_oversized_request_bodies_get_413(api: Call) -> None:
    response = await api("POST", "/exec", content=b"x" * (3 * 1024 * 1024))
    assert response.status_code == 413
    assert response.json()["code"] == "payload_too_large"


async def test_detail_record_has_timeline_ready_and_activity_times(api: Call) -> None:
    await api("POST")
    await wait_for(api, lambda b: b["status"] == "active")
    detail = (await api("GET")).json()
    assert detail["status"] == "active"
    assert detail["backend"] == "fake"
    assert [p["phase"] for p in detail["phases"]] == ["compute", "mount", "ready"]
    assert all(p["endedAt"] for p in detail["phases"])
    assert detail["readyAt"] == detail["phases"][-1]["endedAt"]
    assert detail["lastActivityAt"] == detail["readyAt"]
    assert "waiting" not in detail
    assert "errorCode" not in detail


async def test_phase_statistics_are_stored_and_shape_the_next_eta(
    api: Call, services: Services, backend: FakeBackend
) -> None:
    await api("POST")
    await wait_for(api, lambda b: b["status"] == "active")
    stats = await services.sandboxes.phase_stats("fake")
    assert set(stats) == {Phase.COMPUTE, Phase.MOUNT, Phase.READY}
    assert all(s.samples == 1 for s in stats.values())
    # The next launch is estimated from what was stored (read back from the database by
    # the driver), not from the priors: the first launch was far quicker than they say.
    from_priors = seconds_until_ready("fake", Phase.COMPUTE, {})
    from_stats = seconds_until_ready("fake", Phase.COMPUTE, stats)
    assert from_stats < from_priors - 2
    await api("DELETE")
    backend.delays = {Phase.COMPUTE: 1.0}
    await api("POST")
    body = await wait_for(api, lambda b: "etaSeconds" in b and b.get("phase") == "compute")
    assert abs(body["etaSeconds"] - from_stats) <= 1


async def test_two_workers_never_drive_the_same_sandbox(
    client: httpx.AsyncClient,
    world: World,
    services: Services,
    backend: FakeBackend,
    engine_settings: EngineSettings,
) -> None:
    second = Provisioner(
        services.sandboxes,
        backend,
        services.clock,
        engine_settings,
        poll_interval=0.01,
        monitor_interval=0.05,
    )
    await second.start()
    try:
        key = await world.key()
        chats = [await world.chat() for _ in range(8)]
        for chat in chats:
            await client.post(f"/v1/sandbox/{chat}", headers={"X-Ivy-Api-Key": key})
        for _ in range(500):
            statuses = [
                (
                    await client.get(f"/v1/sandbox/{c}/status", headers={"X-Ivy-Api-Key": key})
                ).json()["status"]
                for c in chats
            ]
            if all(s == "active" for s in statuses):
                break
            await asyncio.sleep(0.01)
        assert all(s == "active" for s in statuses)
        started = [sid for phase, sid in backend.calls if phase == "compute"]
        assert len(started) == len(set(started)) == len(chats)
    finally:
        await second.aclose()


async def test_eta_counts_down_never_negative_and_never_jumps_up_within_a_phase(
    api: Call, backend: FakeBackend
) -> None:
    backend.delays = {Phase.COMPUTE: 0.6, Phase.MOUNT: 0.6, Phase.READY: 0.3}
    await api("POST")
    samples: list[tuple[str, int]] = []
    while True:
        body = (await api("GET", "/status")).json()
        if body["status"] != "provisioning":
            break
        if "etaSeconds" in body:
            samples.append((body["phase"], body["etaSeconds"]))
        await asyncio.sleep(0.02)
    assert samples
    assert all(eta >= 0 for _, eta in samples)
    for (phase_a, eta_a), (phase_b, eta_b) in itertools.pairwise(samples):
        if phase_a == phase_b:
            assert eta_b <= eta_a + 1


async def test_launches_have_their_own_smaller_rate_limit(
    client: httpx.AsyncClient, world: World, services: Services
) -> None:
    from ivy_sandbox.ratelimit import RateLimiter, make_storage

    services.limiter = RateLimiter(
        make_storage(None),
        per_user="1000/minute",
        per_chat="1000/minute",
        auth_failures="1000/minute",
        per_launch="2/minute",
    )
    key = await world.key()
    chats = [await world.chat() for _ in range(3)]
    codes = [
        (await client.post(f"/v1/sandbox/{chat}", headers={"X-Ivy-Api-Key": key})).status_code
        for chat in chats
    ]
    assert codes == [202, 202, 429]
    refused = await client.post(f"/v1/sandbox/{chats[2]}", headers={"X-Ivy-Api-Key": key})
    assert refused.headers["ratelimit-policy"] == '"launch";q=2;w=60'
    status = await client.get(f"/v1/sandbox/{chats[2]}/status", headers={"X-Ivy-Api-Key": key})
    assert status.status_code == 200  # polling is not a launch


class ExplodingBackend(FakeBackend):
    async def mount(self, spec: Any, state: Any) -> Any:
        raise ValueError("a bug, not a BackendError")


@pytest.mark.parametrize("backend", [ExplodingBackend()], ids=["exploding"])
async def test_an_unexpected_backend_error_fails_the_launch_instead_of_stranding_it(
    api: Call, backend: FakeBackend
) -> None:
    await api("POST")
    body = await wait_for(api, lambda b: b["status"] == "failed")
    assert body["errorMessage"].startswith("mount: unexpected error")
    assert "a bug" not in body["errorMessage"]  # internals stay in the log
    assert (await api("GET")).json()["errorCode"] == "internal_error"
    assert backend.running == {}


async def test_oversized_headers_get_431_with_a_problem_body(
    client: httpx.AsyncClient, world: World
) -> None:
    key, chat = await world.key(), await world.chat()
    headers = {"X-Ivy-Api-Key": key, "Cookie": "a=" + "x" * 20_000}
    response = await client.get(f"/v1/sandbox/{chat}/status", headers=headers)
    assert response.status_code == 431
    assert response.json()["code"] == "headers_too_large"
    assert response.headers["cache-control"] == "no-store"

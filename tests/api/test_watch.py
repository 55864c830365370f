"""Watching a launch: Server-Sent Events and long-poll, in one process and across processes."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import World
from fakes import FakeClock, WallClock
from ivy_sandbox.auth.credentials import Credential, CredentialType
from ivy_sandbox.auth.principal import Principal
from ivy_sandbox.backends.fake import FakeBackend
from ivy_sandbox.bootstrap import Services
from ivy_sandbox.domain.sandbox import Phase
from ivy_sandbox.errors import AuthenticationFailed
from ivy_sandbox.events import PostgresEventBus
from ivy_sandbox.ratelimit import RateLimiter, make_storage
from ivy_sandbox.services import watch
from ivy_sandbox.services.watch import Watching

pytestmark = pytest.mark.usefixtures("worker")


@pytest.fixture
def clock() -> WallClock:  # type: ignore[override]
    return WallClock()


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend(delays={Phase.COMPUTE: 0.2, Phase.MOUNT: 0.2, Phase.READY: 0.2})


def parse_sse(text: str) -> list[dict[str, Any]]:
    events = []
    for block in text.split("\n\n"):
        fields = dict(
            line.split(": ", 1)
            for line in block.splitlines()
            if ": " in line and not line.startswith(":")
        )
        if fields.get("event") == "status":
            events.append({"id": fields["id"], **json.loads(fields["data"])})
    return events


async def test_sse_sends_the_current_status_then_each_change_and_ends_when_active(
    client: httpx.AsyncClient, world: World
) -> None:
    key, chat = await world.key(), await world.chat()
    headers = {"X-Ivy-Api-Key": key}
    await client.post(f"/v1/sandbox/{chat}", headers=headers)
    response = await client.get(f"/v1/sandbox/{chat}/events", headers=headers)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-store"
    events = parse_sse(response.text)
    phases = [(e["status"], e.get("phase")) for e in events]
    assert phases[0] == ("provisioning", "compute")
    assert phases[-1] == ("active", "ready")
    assert ("provisioning", "mount") in phases
    assert len({e["id"] for e in events}) == len(events)  # one event per change, no repeats
    for event in events:  # each is exactly the status body (plus its id)
        body = {k: v for k, v in event.items() if k != "id"}
        assert set(body) <= {"status", "phase", "etaSeconds", "errorMessage", "createdAt"}


async def test_sse_on_a_chat_without_sandbox_sends_none_and_ends(
    client: httpx.AsyncClient, world: World
) -> None:
    key, chat = await world.key(), await world.chat()
    response = await client.get(f"/v1/sandbox/{chat}/events", headers={"X-Ivy-Api-Key": key})
    assert parse_sse(response.text) == [{"id": "none", "status": "none"}]


async def test_sse_on_a_failed_sandbox_sends_the_failure_and_ends(
    client: httpx.AsyncClient, world: World
) -> None:
    key, chat = await world.key(), await world.chat()
    await world.sandbox(
        chat, "failed", "failed", error_code="mount_failed", error_message="mount: no disk"
    )
    response = await client.get(f"/v1/sandbox/{chat}/events", headers={"X-Ivy-Api-Key": key})
    events = parse_sse(response.text)  # the stream ended: the whole response is here
    assert len(events) == 1
    assert (events[0]["status"], events[0]["phase"]) == ("failed", "failed")
    assert events[0]["errorMessage"] == "mount: no disk"


async def test_sse_over_the_chat_rate_limit_is_an_ordinary_429_with_retry_after(
    client: httpx.AsyncClient, world: World, services: Services
) -> None:
    services.limiter = RateLimiter(
        make_storage(None), per_user="1000/minute", per_chat="2/minute", auth_failures="1000/minute"
    )
    key, chat = await world.key(), await world.chat()
    headers = {"X-Ivy-Api-Key": key}
    answers = [await client.get(f"/v1/sandbox/{chat}/events", headers=headers) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 429]
    assert int(answers[2].headers["retry-after"]) >= 1
    assert answers[2].json()["code"] == "rate_limited"


async def test_sse_with_a_project_scoped_key_sees_its_project_only(
    client: httpx.AsyncClient, world: World
) -> None:
    project = await world.project()
    key = await world.key(project_id=project)
    inside, outside = await world.chat(project_id=project), await world.chat()
    headers = {"X-Ivy-Api-Key": key}
    allowed = await client.get(f"/v1/sandbox/{inside}/events", headers=headers)
    assert (allowed.status_code, parse_sse(allowed.text)[0]["status"]) == (200, "none")
    denied = await client.get(f"/v1/sandbox/{outside}/events", headers=headers)
    assert (denied.status_code, denied.json()["code"]) == (403, "forbidden")


async def test_sse_refusals_are_ordinary_401_and_403_responses(
    client: httpx.AsyncClient, world: World, tokens: Any
) -> None:
    key = await world.key()
    assert (await client.get("/v1/sandbox/chat_x/events")).status_code == 401
    denied = await client.get("/v1/sandbox/chat_x/events", headers={"X-Ivy-Api-Key": key})
    assert denied.status_code == 403
    assert denied.json()["code"] == "forbidden"
    chat = await world.chat()
    cookie = {"Cookie": f"__session={tokens.token()}"}  # browsers' EventSource sends cookies
    assert (await client.get(f"/v1/sandbox/{chat}/events", headers=cookie)).status_code == 200


async def test_an_sse_stream_ends_when_its_credential_stops_being_valid(
    services: Services, world: World
) -> None:
    chat = await world.chat()
    await world.sandbox(chat, "provisioning", "compute")
    principal = await services.authenticator.authenticate(
        __import__("ivy_sandbox.auth.credentials", fromlist=["x"]).Credential(
            __import__("ivy_sandbox.auth.credentials", fromlist=["x"]).CredentialType.API_KEY,
            await world.key(),
        )
    )
    checks = 0

    async def revoked_after_first_check() -> None:
        nonlocal checks
        checks += 1
        if checks > 1:
            raise AuthenticationFailed("revoked")

    stream = await watch.status_stream(
        services.watching,
        principal,
        chat,
        still_authenticated=revoked_after_first_check,
        keepalive_seconds=0.05,
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].startswith("event: error")
    assert '"unauthenticated"' in chunks[-1]
    assert any(chunk.startswith(": keep-alive") for chunk in chunks)


async def test_long_poll_answers_as_soon_as_the_phase_changes(
    client: httpx.AsyncClient, world: World
) -> None:
    key, chat = await world.key(), await world.chat()
    headers = {"X-Ivy-Api-Key": key}
    first = (await client.post(f"/v1/sandbox/{chat}", headers=headers)).json()
    started = time.monotonic()
    response = await client.get(
        f"/v1/sandbox/{chat}/status", headers=headers | {"Prefer": "wait=20"}
    )
    elapsed = time.monotonic() - started
    assert response.status_code == 200
    assert response.headers["preference-applied"] == "wait=20"
    assert (
        response.json()["phase"] != first["phase"] or response.json()["status"] != first["status"]
    )
    assert elapsed < 5  # far sooner than the 20 s it was allowed to wait
    token = response.headers["etag"].strip('"')
    again = await client.get(
        f"/v1/sandbox/{chat}/status",
        params={"since": token},
        headers=headers | {"Prefer": "wait=20"},
    )
    assert again.headers["etag"].strip('"') != token


async def test_long_poll_without_a_change_returns_the_current_body_after_the_wait(
    client: httpx.AsyncClient, world: World
) -> None:
    key, chat = await world.key(), await world.chat()
    headers = {"X-Ivy-Api-Key": key, "Prefer": "wait=1"}
    started = time.monotonic()
    response = await client.get(f"/v1/sandbox/{chat}/status", headers=headers)
    assert time.monotonic() - started >= 0.9
    assert (response.status_code, response.json()) == (200, {"status": "none"})


@pytest.mark.parametrize("prefer", ["wait=abc", "respond-async", "wait=-1", ""])
async def test_unusable_prefer_values_answer_at_once_like_a_plain_poll(
    client: httpx.AsyncClient, world: World, prefer: str
) -> None:
    key, chat = await world.key(), await world.chat()
    response = await client.get(
        f"/v1/sandbox/{chat}/status", headers={"X-Ivy-Api-Key": key, "Prefer": prefer}
    )
    assert (response.status_code, response.json()) == (200, {"status": "none"})
    assert "preference-applied" not in response.headers


async def test_long_poll_wait_is_capped_at_sixty_seconds(
    client: httpx.AsyncClient, world: World
) -> None:
    key, chat = await world.key(), await world.chat()
    await client.post(f"/v1/sandbox/{chat}", headers={"X-Ivy-Api-Key": key})
    response = await client.get(
        f"/v1/sandbox/{chat}/status", headers={"X-Ivy-Api-Key": key, "Prefer": "wait=3600"}
    )
    assert response.headers["preference-applied"] == "wait=60"


@pytest.mark.postgres
async def test_a_change_made_by_a_worker_process_reaches_a_waiting_client_through_postgres(
    client: httpx.AsyncClient, world: World, services: Services, database_url: str, tmp_path: Path
) -> None:
    if not database_url.startswith("postgresql"):
        pytest.skip("cross-process delivery needs the LISTEN/NOTIFY bus; this is the SQLite run")
    # The API side: PostgreSQL events, no in-process worker (it would drive the launch itself).
    assert services.provisioner is not None
    await services.provisioner.aclose()
    services.provisioner = None
    bus = PostgresEventBus(database_url)
    await bus.start()
    services.bus = bus
    services.sandboxes.bus = bus
    worker = subprocess.Popen(  # noqa: ASYNC220 - started once, outside the timed part
        [str(Path(sys.executable).parent / "ivy-sandbox"), "worker"],
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("IVY_")},
            "IVY_DATA_DIR": str(tmp_path),
            "IVY_DATABASE_URL": database_url,
            "IVY_SANDBOX_BACKEND": "latency-fake",
        },
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        key, chat = await world.key(), await world.chat()
        headers = {"X-Ivy-Api-Key": key}
        body = (await client.post(f"/v1/sandbox/{chat}", headers=headers)).json()
        seen = [(body["status"], body["phase"])]
        token = None
        deadline = time.monotonic() + 30
        while seen[-1][0] != "active" and time.monotonic() < deadline:
            params = {"since": token} if token else {}
            # With no event the wait would run its full 10 s and the re-check is 15 s away:
            # only a NOTIFY from the worker process can end these waits early.
            started = time.monotonic()
            response = await client.get(
                f"/v1/sandbox/{chat}/status", params=params, headers=headers | {"Prefer": "wait=10"}
            )
            token = response.headers["etag"].strip('"')
            current = response.json()
            if (current["status"], current.get("phase")) != seen[-1]:
                assert time.monotonic() - started < 9, "a change arrived only when the wait ran out"
                seen.append((current["status"], current.get("phase")))
        assert seen[-1] == ("active", "ready")
        assert ("provisioning", "mount") in seen
    finally:
        worker.terminate()
        worker.wait(timeout=10)
        await bus.aclose()


# -- keep-alives and credential checks stay on time when wake-ups change nothing ---------------
INTERVAL = 1.0  # the keep-alive interval under test, in the scripted clock's seconds
SPURIOUS_EVERY = 0.9 * INTERVAL  # wake-ups just short of the interval: the worst case


class SpuriousWakeups:
    """A subscription that wakes every ``every`` seconds of a :class:`FakeClock` without any
    change behind it (a coalesced or duplicated notification, a NOTIFY from a reconnect).

    ``wait`` advances the fake clock instead of sleeping, so the schedule the watch keeps is
    exact and the test measures it without depending on how fast this machine is."""

    def __init__(self, clock: FakeClock, every: float) -> None:
        self.clock = clock
        self.every = every
        self.next_wakeup = clock.monotonic() + every

    async def wait(self, seconds: float) -> bool:
        now = self.clock.monotonic()
        if self.next_wakeup <= now + seconds:
            self.clock.advance(max(0.0, self.next_wakeup - now))
            self.next_wakeup += self.every
            return True
        self.clock.advance(seconds)
        return False


class SpuriousBus:
    """An event bus whose every subscription is :class:`SpuriousWakeups`."""

    cross_process = False

    def __init__(self, clock: FakeClock, every: float) -> None:
        self.clock = clock
        self.every = every

    async def in_transaction(self, conn: Any, chat_id: str) -> None:
        return None

    def after_commit(self, chat_id: str) -> None:
        return None

    @contextlib.asynccontextmanager
    async def subscribe(self, chat_id: str) -> AsyncIterator[SpuriousWakeups]:
        yield SpuriousWakeups(self.clock, self.every)

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None


@pytest.fixture
def scripted_clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def spurious_watching(services: Services, scripted_clock: FakeClock) -> Watching:
    """The real repository and limiter; a scripted clock and bus; no periodic re-check
    (so only the spurious wake-ups and the keep-alive deadline end a wait)."""
    return dataclasses.replace(
        services.watching,
        bus=SpuriousBus(scripted_clock, SPURIOUS_EVERY),  # type: ignore[arg-type]
        clock=scripted_clock,
        recheck_seconds=60 * INTERVAL,
    )


@pytest.fixture
async def quiet_chat(world: World) -> str:
    """A provisioning sandbox that nothing changes: its lease belongs to a worker elsewhere,
    so this module's worker leaves it alone."""
    chat = await world.chat()
    await world.sandbox(
        chat,
        "provisioning",
        "compute",
        lease_owner="elsewhere.example:1:abcd",
        lease_expires_at=world.clock.now() + timedelta(hours=1),
    )
    return chat


@pytest.fixture
async def principal(services: Services, world: World) -> Principal:
    key = await world.key()
    return await services.authenticator.authenticate(Credential(CredentialType.API_KEY, key))


async def test_sse_keepalives_come_every_interval_even_when_wakeups_change_nothing(
    spurious_watching: Watching, scripted_clock: FakeClock, quiet_chat: str, principal: Principal
) -> None:
    async def still_valid() -> None:
        return None

    stream = await watch.status_stream(
        spurious_watching,
        principal,
        quiet_chat,
        still_authenticated=still_valid,
        keepalive_seconds=INTERVAL,
    )
    written: list[tuple[float, str]] = []
    async for chunk in stream:
        written.append((scripted_clock.monotonic(), chunk))
        if sum(c.startswith(": keep-alive") for _, c in written) == 6:
            break
    await stream.aclose()  # type: ignore[attr-defined]

    assert written[0][1] == "retry: 2000\n\n"
    assert "event: status" in written[1][1]
    gaps = [b - a for a, b in itertools.pairwise(at for at, _ in written[1:])]
    assert all(chunk.startswith(": keep-alive") for _, chunk in written[2:])
    # Old behaviour: each spurious wake-up restarted the interval, so gaps were 1.8 intervals.
    assert max(gaps) <= INTERVAL + 1e-6, gaps


async def test_long_poll_credential_checks_keep_their_cadence_when_wakeups_change_nothing(
    spurious_watching: Watching, scripted_clock: FakeClock, quiet_chat: str, principal: Principal
) -> None:
    checks: list[float] = []

    async def still_valid() -> None:
        checks.append(scripted_clock.monotonic())

    started = scripted_clock.monotonic()
    body, _ = await watch.wait_for_change(
        spurious_watching,
        principal,
        quiet_chat,
        since=None,
        wait_seconds=10 * INTERVAL,
        still_authenticated=still_valid,
        keepalive_seconds=INTERVAL,
    )
    assert body["status"] == "provisioning"
    assert scripted_clock.monotonic() - started == pytest.approx(10 * INTERVAL)
    gaps = [b - a for a, b in zip([started, *checks], checks, strict=False)]
    assert len(checks) >= 9
    assert max(gaps) <= INTERVAL + 1e-6, gaps

"""A long-poll whose credential stops being valid while it waits ends with the ordinary 401.

The watch re-checks the credential every ``IVY_WATCH_KEEPALIVE_SECONDS`` (shortened here so
the tests take well under a second each). Time bounds are loop limits (``asyncio.wait_for``
with a generous timeout), never assertions on speed: the wait the client asked for is 30 s,
so an answer within the bound can only come from the re-check.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import update

from conftest import TokenFactory, World
from ivy_sandbox.auth.api_keys import parse_api_key
from ivy_sandbox.auth.credentials import Credential, CredentialType
from ivy_sandbox.auth.principal import Principal
from ivy_sandbox.bootstrap import Services
from ivy_sandbox.errors import AuthenticationFailed
from ivy_sandbox.services import accounts, watch
from ivy_sandbox.services.authentication import KEY_CACHE_SECONDS
from ivy_sandbox.storage.tables import sandboxes

CHECK_SECONDS = 0.1  # the keep-alive / credential re-check interval under test
ASKED_WAIT = 30  # what the long-polls ask for: far longer than any bound below
BOUND = 10.0  # generous loop limit for "the wait ended because of the re-check"


class ShiftableClock:
    """Real time that a test can move forward: wall time (expiry) and, separately, monotonic
    time (cache ages; the waits themselves stay real)."""

    def __init__(self) -> None:
        self.offset = timedelta(0)
        self.monotonic_offset = 0.0

    def now(self) -> datetime:
        return datetime.now(UTC) + self.offset

    def monotonic(self) -> float:
        return time.monotonic() + self.monotonic_offset

    def time(self) -> float:
        return self.now().timestamp()

    def advance(self, seconds: float) -> None:
        self.offset += timedelta(seconds=seconds)

    def age_caches(self, seconds: float) -> None:
        self.monotonic_offset += seconds


@pytest.fixture
def clock() -> ShiftableClock:
    return ShiftableClock()


@pytest.fixture(autouse=True)
def fast_checks(services: Services) -> None:
    services.settings = services.settings.model_copy(
        update={"watch_keepalive_seconds": CHECK_SECONDS}
    )


@pytest.fixture
async def provisioning_chat(world: World) -> str:
    """A chat whose sandbox stays provisioning: no worker runs in this module."""
    chat = await world.chat()
    await world.sandbox(chat, "provisioning", "compute")
    return chat


@pytest.fixture
async def key(world: World) -> str:
    return await world.key()


async def long_poll(
    client: httpx.AsyncClient, chat: str, headers: dict[str, str]
) -> httpx.Response:
    return await client.get(
        f"/v1/sandbox/{chat}/status", headers=headers | {"Prefer": f"wait={ASKED_WAIT}"}
    )


async def started(
    coroutine: Coroutine[Any, Any, httpx.Response],
) -> asyncio.Task[httpx.Response]:
    task = asyncio.create_task(coroutine)
    await asyncio.sleep(3 * CHECK_SECONDS)  # let it pass a few checks while valid
    assert not task.done(), "the long-poll answered before anything changed"
    return task


def assert_ordinary_401(response: httpx.Response, reference: httpx.Response) -> None:
    assert response.status_code == 401
    assert response.headers["content-type"] == "application/problem+json"
    assert response.headers["www-authenticate"] == 'Bearer realm="ivy", error="invalid_token"'
    assert response.json()["code"] == "unauthenticated"
    # The same class of failure gets the same body as a fresh request with that credential.
    assert reference.status_code == 401
    assert response.content == reference.content
    assert "preference-applied" not in response.headers
    assert "etag" not in response.headers


async def test_a_key_revoked_through_the_api_ends_a_waiting_long_poll_with_401(
    client: httpx.AsyncClient, tokens: TokenFactory, provisioning_chat: str, key: str
) -> None:
    headers = {"X-Ivy-Api-Key": key}
    task = await started(long_poll(client, provisioning_chat, headers))
    session = {"Authorization": f"Bearer {tokens.token()}"}
    kid = parse_api_key(key).kid
    assert (await client.delete(f"/v1/api-keys/{kid}", headers=session)).status_code == 204
    response = await asyncio.wait_for(task, BOUND)
    reference = await client.get(f"/v1/sandbox/{provisioning_chat}/status", headers=headers)
    assert_ordinary_401(response, reference)


async def test_a_key_revoked_by_another_process_ends_the_wait_once_the_cache_lets_go(
    client: httpx.AsyncClient,
    services: Services,
    clock: ShiftableClock,
    provisioning_chat: str,
    key: str,
) -> None:
    # Another process (the admin CLI) writes the revocation; this one sees it when its key
    # cache entry (at most 5 s old) expires — the next re-check after that fails.
    headers = {"Authorization": f"Bearer {key}"}
    task = await started(long_poll(client, provisioning_chat, headers))
    await accounts.revoke_api_key(services.repository, services.clock, parse_api_key(key).kid)
    clock.age_caches(KEY_CACHE_SECONDS + 1)  # the long-poll's own 30 s deadline is still far
    response = await asyncio.wait_for(task, BOUND)
    reference = await client.get(f"/v1/sandbox/{provisioning_chat}/status", headers=headers)
    assert_ordinary_401(response, reference)


async def test_a_key_that_expires_during_the_wait_ends_it_with_401(
    client: httpx.AsyncClient, world: World, clock: ShiftableClock, provisioning_chat: str
) -> None:
    key = await world.key(expires_in=timedelta(seconds=60))
    headers = {"X-Ivy-Api-Key": key}
    task = await started(long_poll(client, provisioning_chat, headers))
    clock.advance(120)
    response = await asyncio.wait_for(task, BOUND)
    reference = await client.get(f"/v1/sandbox/{provisioning_chat}/status", headers=headers)
    assert_ordinary_401(response, reference)


async def test_a_session_token_that_expires_during_the_wait_ends_it_with_401(
    client: httpx.AsyncClient, tokens: TokenFactory, clock: ShiftableClock, world: World
) -> None:
    chat = await world.chat("user_alice")  # the session's user
    await world.sandbox(chat, "provisioning", "mount")
    token = tokens.token(exp=int(clock.time()) + 30)
    headers = {"Authorization": f"Bearer {token}"}
    task = await started(long_poll(client, chat, headers))
    clock.advance(30 + 5 + 1)  # past exp and the 5 s leeway
    response = await asyncio.wait_for(task, BOUND)
    reference = await client.get(f"/v1/sandbox/{chat}/status", headers=headers)
    assert_ordinary_401(response, reference)


async def test_a_browser_session_cookie_that_expires_during_the_wait_ends_it_with_401(
    client: httpx.AsyncClient, tokens: TokenFactory, clock: ShiftableClock, world: World
) -> None:
    chat = await world.chat("user_alice")
    await world.sandbox(chat, "provisioning", "compute")
    cookie = {"Cookie": f"__session={tokens.token(exp=int(clock.time()) + 30)}"}
    task = await started(long_poll(client, chat, cookie))
    clock.advance(36)
    response = await asyncio.wait_for(task, BOUND)
    assert response.status_code == 401
    assert response.json()["code"] == "unauthenticated"


async def test_a_valid_credential_keeps_waiting_through_many_checks_and_gets_the_change(
    client: httpx.AsyncClient, services: Services, provisioning_chat: str, key: str
) -> None:
    headers = {"X-Ivy-Api-Key": key}
    task = await started(long_poll(client, provisioning_chat, headers))
    await asyncio.sleep(5 * CHECK_SECONDS)
    assert not task.done()
    # Written behind the event bus's back: the periodic re-read (1 s here) finds it.
    async with services.repository.engine.begin() as conn:
        await conn.execute(
            update(sandboxes).where(sandboxes.c.chat_id == provisioning_chat).values(phase="mount")
        )
    response = await asyncio.wait_for(task, BOUND)
    assert response.status_code == 200
    assert (response.json()["status"], response.json()["phase"]) == ("provisioning", "mount")


async def test_a_long_poll_that_runs_out_with_a_valid_credential_is_an_ordinary_200(
    client: httpx.AsyncClient, provisioning_chat: str, key: str
) -> None:
    response = await client.get(
        f"/v1/sandbox/{provisioning_chat}/status",
        headers={"X-Ivy-Api-Key": key, "Prefer": "wait=1"},
    )
    assert response.status_code == 200
    assert response.headers["preference-applied"] == "wait=1"
    assert response.json()["phase"] == "compute"


# -- the use case alone --------------------------------------------------------------------
@pytest.fixture
async def principal(services: Services, key: str) -> Principal:
    return await services.authenticator.authenticate(Credential(CredentialType.API_KEY, key))


async def test_wait_for_change_checks_the_credential_at_its_cadence_while_waiting(
    services: Services, provisioning_chat: str, principal: Principal
) -> None:
    checks: list[float] = []

    async def still_valid() -> None:
        checks.append(time.monotonic())

    started_at = time.monotonic()
    body, _ = await watch.wait_for_change(
        services.watching,
        principal,
        provisioning_chat,
        since=None,
        wait_seconds=1,
        still_authenticated=still_valid,
        keepalive_seconds=0.2,
    )
    assert body["status"] == "provisioning"
    assert 2 <= len(checks) <= 10  # about every 0.2 s over 1 s; never a busy loop
    assert all(b - a >= 0.15 for a, b in zip([started_at, *checks], checks, strict=False))


async def test_wait_for_change_raises_authentication_failed_on_the_first_failing_check(
    services: Services, provisioning_chat: str, principal: Principal
) -> None:
    calls = 0

    async def revoked_on_third_check() -> None:
        nonlocal calls
        calls += 1
        if calls >= 3:
            raise AuthenticationFailed("revoked")

    with pytest.raises(AuthenticationFailed):
        await asyncio.wait_for(
            watch.wait_for_change(
                services.watching,
                principal,
                provisioning_chat,
                since=None,
                wait_seconds=ASKED_WAIT,
                still_authenticated=revoked_on_third_check,
                keepalive_seconds=0.05,
            ),
            BOUND,
        )
    assert calls == 3


async def test_without_a_checker_the_wait_is_as_before(
    services: Services, provisioning_chat: str, principal: Principal
) -> None:
    body, token = await watch.wait_for_change(
        services.watching,
        principal,
        provisioning_chat,
        since="something-else",  # differs at once: answered without waiting
        wait_seconds=ASKED_WAIT,
    )
    assert body["status"] == "provisioning"
    assert token != "something-else"

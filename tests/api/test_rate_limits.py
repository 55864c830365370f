"""Rate limits through the HTTP app: per user, per (user, chat), failed logins per client IP.

Every test runs on the in-memory limiter storage and on Redis (skipped without
``IVY_TEST_REDIS_URL``), and on both databases. Each test lowers the limit it trips (the
others stay high); the default-limit tests use the real ``Settings()`` defaults.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from urllib.parse import quote

import httpx
import pytest
from limits import parse
from limits.aio.storage import RedisStorage

from conftest import (
    PEPPER,
    REDIS_URL,
    TokenFactory,
    World,
    drop_redis_limiter,
    make_redis_limiter,
    service_unavailable,
)
from ivy_sandbox.api.app import create_app
from ivy_sandbox.bootstrap import Services
from ivy_sandbox.config import Settings
from ivy_sandbox.ratelimit import RateLimiter, make_storage
from ivy_sandbox.services.authentication import Authenticator

CLIENT_IP = "203.0.113.7"  # the conftest client's address
OTHER_IP = "198.51.100.9"
UNREACHABLE_REDIS = "redis://127.0.0.1:1/0"
BASE_LIMITS = {"per_user": "1000/minute", "per_chat": "1000/minute", "auth_failures": "1000/minute"}
RATE_LIMIT_ENV = ("IVY_RATE_LIMIT", "IVY_RATE_LIMIT_PER_CHAT", "IVY_AUTH_FAILURE_LIMIT")
RATELIMIT_HEADER = re.compile(r'^"(?P<policy>[a-z-]+)";r=(?P<r>\d+);t=(?P<t>\d+)$')


def with_limits(**overrides: str) -> pytest.MarkDecorator:
    """Run the test with these limits (the rest stay high)."""
    label = ",".join(f"{k}={v}" for k, v in overrides.items())
    return pytest.mark.parametrize("limits", [overrides], indirect=True, ids=[label])


def default_settings(monkeypatch: pytest.MonkeyPatch) -> Settings:
    for name in RATE_LIMIT_ENV:
        monkeypatch.delenv(name, raising=False)
    return Settings()


@pytest.fixture
def limits(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    param = getattr(request, "param", None)
    if param == "defaults":
        settings = default_settings(monkeypatch)
        return {
            "per_user": settings.rate_limit,
            "per_chat": settings.rate_limit_per_chat,
            "auth_failures": settings.auth_failure_limit,
        }
    return {**BASE_LIMITS, **(param or {})}


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def limiter(
    request: pytest.FixtureRequest, limits: dict[str, str]
) -> AsyncIterator[RateLimiter]:
    """Overrides conftest's pairing: here both storages run on both databases."""
    if request.param == "memory":
        yield RateLimiter(make_storage(None), **limits)
        return
    if request.param == "unreachable-redis":
        storage = make_storage(UNREACHABLE_REDIS, key_prefix=uuid.uuid4().hex)
        assert isinstance(storage, RedisStorage)
        yield RateLimiter(storage, **limits)
        await storage.bridge.storage.aclose()
        return
    if not REDIS_URL:
        service_unavailable("IVY_TEST_REDIS_URL is not set (no Redis for this run)")
    limiter = make_redis_limiter(limits)  # a prefix of its own: no counter shared with others
    try:
        yield limiter
    finally:
        await drop_redis_limiter(limiter)


@asynccontextmanager
async def app_client(services: Services, ip: str = CLIENT_IP) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client for an app built on ``services``, calling from ``ip``."""
    app = create_app(services.settings, services=services)
    transport = httpx.ASGITransport(app=app, client=(ip, 40000))
    async with httpx.AsyncClient(transport=transport, base_url="http://ivy.test") as client:
        yield client


async def status(
    client: httpx.AsyncClient, chat_id: str, key: str | None = None, **headers: str
) -> httpx.Response:
    if key is not None:
        headers["X-Ivy-Api-Key"] = key
    return await client.get(f"/v1/sandbox/{quote(chat_id, safe='')}/status", headers=headers)


def assert_rate_limited(
    response: httpx.Response, policy: str, limit: int, window: int = 60
) -> None:
    """A 429 with the problem body, no-store, and consistent draft RateLimit headers."""
    assert response.status_code == 429, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body = response.json()
    assert body["code"] == "rate_limited"
    assert body["status"] == 429
    assert response.headers["cache-control"] == "no-store"
    retry_after = response.headers["retry-after"]
    assert retry_after.isdigit(), retry_after
    assert 1 <= int(retry_after) <= window
    assert response.headers["ratelimit-policy"] == f'"{policy}";q={limit};w={window}'
    match = RATELIMIT_HEADER.match(response.headers["ratelimit"])
    assert match is not None, response.headers["ratelimit"]
    assert match["policy"] == policy
    assert match["r"] == "0"
    assert 1 <= int(match["t"]) <= window
    assert int(match["t"]) == int(retry_after)


# -- per user ----------------------------------------------------------------------------------
@with_limits(per_user="5/minute")
async def test_per_user_limit_answers_429_with_retry_after_and_ratelimit_headers(
    client: httpx.AsyncClient, world: World
) -> None:
    key = await world.key()
    chats = [await world.chat(), await world.chat()]
    for i in range(5):
        assert (await status(client, chats[i % 2], key)).status_code == 200
    response = await status(client, chats[1], key)
    assert_rate_limited(response, "user", 5)
    assert "ratelimit" not in (await status(client, "x", None)).headers  # 401: no limit headers


@with_limits(per_user="3/minute")
async def test_per_user_limit_counts_the_user_not_the_key_and_spares_other_users(
    client: httpx.AsyncClient, world: World
) -> None:
    first_key, second_key = await world.key(), await world.key()
    chat = await world.chat()
    for _ in range(3):
        assert (await status(client, chat, first_key)).status_code == 200
    assert_rate_limited(await status(client, chat, second_key), "user", 3)
    bob_key, bob_chat = await world.key("user_bob"), await world.chat("user_bob")
    assert (await status(client, bob_chat, bob_key)).status_code == 200


# -- per (user, chat) --------------------------------------------------------------------------
@with_limits(per_chat="3/minute")
async def test_per_chat_limit_trips_for_one_chat_while_another_chat_still_answers(
    client: httpx.AsyncClient, world: World
) -> None:
    key = await world.key()
    busy, quiet = await world.chat(), await world.chat()
    for _ in range(3):
        assert (await status(client, busy, key)).status_code == 200
    assert_rate_limited(await status(client, busy, key), "chat", 3)
    assert (await status(client, quiet, key)).status_code == 200
    assert_rate_limited(await status(client, busy, key), "chat", 3)


@with_limits(per_chat="3/minute")
async def test_malformed_chat_ids_share_one_counter_and_get_403_until_limited(
    client: httpx.AsyncClient, world: World
) -> None:
    key = await world.key()
    junk = ["has space", "x" * 65, "-dash-first", "semi;colon", "ünïcode", "a.b"]
    for chat_id in junk[:3]:
        response = await status(client, chat_id, key)
        assert response.status_code == 403
        assert response.json()["code"] == "forbidden"
    # Three different malformed ids used up one shared counter: the fourth is limited.
    for chat_id in junk[3:]:
        assert_rate_limited(await status(client, chat_id, key), "chat", 3)
    # Well-formed ids keep their own counters.
    assert (await status(client, "chat_doesnotexist", key)).status_code == 403
    assert (await status(client, await world.chat(), key)).status_code == 200


# -- failed authentications per client IP ------------------------------------------------------
@with_limits(auth_failures="3/minute")
async def test_failed_authentications_are_limited_per_ip_but_valid_keys_still_work(
    client: httpx.AsyncClient, services: Services, world: World
) -> None:
    key, chat = await world.key(), await world.chat()
    failures: list[dict[str, str]] = [
        {},  # no credential at all
        {"Authorization": "Bearer not-a-token"},
        {"X-Ivy-Api-Key": "ivy_nope"},
    ]
    for headers in failures:
        assert (await status(client, chat, **headers)).status_code == 401
    assert_rate_limited(await status(client, chat, None), "auth-failures", 3)
    assert_rate_limited(await status(client, chat, "ivy_wrong"), "auth-failures", 3)
    # A valid key from the same address is not locked out ...
    assert (await status(client, chat, key)).status_code == 200
    # ... and another address has its own count.
    async with app_client(services, OTHER_IP) as other:
        assert (await status(other, chat, "ivy_wrong")).status_code == 401


@with_limits(auth_failures="3/minute")
async def test_successful_requests_do_not_count_toward_the_auth_failure_limit(
    client: httpx.AsyncClient, world: World
) -> None:
    key, chat = await world.key(), await world.chat()
    for _ in range(10):
        assert (await status(client, chat, key)).status_code == 200
    for _ in range(3):
        assert (await status(client, chat, "ivy_wrong")).status_code == 401
    assert_rate_limited(await status(client, chat, "ivy_wrong"), "auth-failures", 3)


# -- every credential form gets the same 429s --------------------------------------------------
# (form, kind of credential, how it is presented); 200/401/403 per form: test_authentication.py
# and test_authorization.py.
CREDENTIAL_FORMS: dict[str, tuple[str, Callable[[str], dict[str, str]]]] = {
    "x-ivy-api-key": ("key", lambda c: {"X-Ivy-Api-Key": c}),
    "bearer-api-key": ("key", lambda c: {"Authorization": f"Bearer {c}"}),
    "bearer-session-jwt": ("session", lambda c: {"Authorization": f"Bearer {c}"}),
    "session-cookie-jwt": ("session", lambda c: {"Cookie": f"__session={c}"}),
}
each_form = pytest.mark.parametrize("form", list(CREDENTIAL_FORMS))


async def credentials(
    form: str, world: World, tokens: TokenFactory
) -> tuple[dict[str, str], dict[str, str]]:
    """Headers carrying a valid and an invalid credential of user_alice, in ``form``."""
    kind, present = CREDENTIAL_FORMS[form]
    if kind == "key":
        good = await world.key("user_alice")
        bad = good[:-1] + ("A" if good[-1] != "A" else "B")  # checksum no longer matches
    else:
        await world.user("user_alice")
        now = int(tokens.clock.time())
        good = tokens.token("user_alice")
        bad = tokens.token("user_alice", exp=now - 60, iat=now - 120, nbf=now - 120)
    return present(good), present(bad)


@each_form
@with_limits(per_user="3/minute")
async def test_per_user_429_carries_its_headers_for_every_credential_form(
    client: httpx.AsyncClient, world: World, tokens: TokenFactory, form: str
) -> None:
    good, _ = await credentials(form, world, tokens)
    chats = [await world.chat(), await world.chat()]
    for i in range(3):
        assert (await status(client, chats[i % 2], **good)).status_code == 200
    assert_rate_limited(await status(client, chats[1], **good), "user", 3)
    assert_rate_limited(await status(client, await world.chat(), **good), "user", 3)


@each_form
@with_limits(per_chat="2/minute")
async def test_per_chat_429_carries_its_headers_for_every_credential_form(
    client: httpx.AsyncClient, world: World, tokens: TokenFactory, form: str
) -> None:
    good, _ = await credentials(form, world, tokens)
    busy, quiet = await world.chat(), await world.chat()
    for _ in range(2):
        assert (await status(client, busy, **good)).status_code == 200
    assert_rate_limited(await status(client, busy, **good), "chat", 2)
    assert (await status(client, quiet, **good)).status_code == 200


@each_form
@with_limits(auth_failures="2/minute")
async def test_auth_failure_429_carries_its_headers_for_every_credential_form(
    client: httpx.AsyncClient, world: World, tokens: TokenFactory, form: str
) -> None:
    good, bad = await credentials(form, world, tokens)
    chat = await world.chat()
    for _ in range(2):
        response = await status(client, chat, **bad)
        assert response.status_code == 401
        assert "ratelimit" not in response.headers
    assert_rate_limited(await status(client, chat, **bad), "auth-failures", 2)
    # The valid credential in the same form, from the same address, still gets through.
    assert (await status(client, chat, **good)).status_code == 200


# -- shared across processes (Redis) -----------------------------------------------------------
@with_limits(per_chat="4/minute", auth_failures="2/minute")
@pytest.mark.parametrize("limiter", ["redis"], indirect=True)
async def test_two_app_instances_on_one_redis_share_the_counters(
    services: Services, world: World, limits: dict[str, str]
) -> None:
    """Two apps with their own limiter and authenticator stand for two server processes."""
    assert REDIS_URL
    prefix = f"ivy-test-{uuid.uuid4().hex}"
    first, second = (
        replace(
            services,
            limiter=RateLimiter(make_storage(REDIS_URL, key_prefix=prefix), **limits),
            authenticator=Authenticator(
                services.repository, PEPPER, services.clerk, services.clock
            ),
        )
        for _ in range(2)
    )
    key, chat = await world.key(), await world.chat()
    try:
        async with app_client(first) as one, app_client(second) as two:
            for client in (one, two, one, two):
                assert (await status(client, chat, key)).status_code == 200
            assert_rate_limited(await status(one, chat, key), "chat", 4)
            assert_rate_limited(await status(two, chat, key), "chat", 4)

            assert (await status(one, chat, "ivy_wrong")).status_code == 401
            assert (await status(two, chat, "ivy_wrong")).status_code == 401
            assert_rate_limited(await status(one, chat, "ivy_wrong"), "auth-failures", 2)
    finally:
        await drop_redis_limiter(first.limiter)  # deletes the shared prefix's keys
        await drop_redis_limiter(second.limiter)  # (none left) and closes its connections


# -- the defaults allow 1 Hz polling of every open chat ----------------------------------------
def test_default_limits_let_one_client_poll_ten_chats_every_second_for_a_minute(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = default_settings(monkeypatch)

    def per_minute(notation: str) -> float:
        item = parse(notation)
        return item.amount * 60 / item.get_expiry()

    assert per_minute(settings.rate_limit_per_chat) >= 60  # one chat, once a second
    assert per_minute(settings.rate_limit) >= 600  # ten chats, once a second


@pytest.mark.parametrize("limits", ["defaults"], indirect=True)
async def test_sixty_polls_of_one_chat_get_no_429_with_the_default_limits(
    client: httpx.AsyncClient, world: World, limits: dict[str, str]
) -> None:
    assert limits["per_chat"] == Settings.model_fields["rate_limit_per_chat"].default
    key, chat = await world.key(), await world.chat()
    codes = [(await status(client, chat, key)).status_code for _ in range(60)]
    assert set(codes) == {200}


# -- fail open ---------------------------------------------------------------------------------
@with_limits(per_user="1/minute", per_chat="1/minute", auth_failures="1/minute")
@pytest.mark.parametrize("limiter", ["unreachable-redis"], indirect=True)
async def test_unreachable_redis_fails_open_instead_of_answering_500(
    client: httpx.AsyncClient, world: World, caplog: pytest.LogCaptureFixture
) -> None:
    key, chat = await world.key(), await world.chat()
    with caplog.at_level(logging.ERROR, logger="ivy_sandbox.ratelimit"):
        for _ in range(3):  # limits of 1/minute would trip if anything were counted
            assert (await status(client, chat, key)).status_code == 200
            assert (await status(client, chat, "ivy_wrong")).status_code == 401
    assert any("rate limiter storage failed" in r.getMessage() for r in caplog.records)

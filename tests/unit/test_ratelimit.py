"""The limiter on its own (ivy_sandbox.ratelimit): headers, storage choice, policies, fail-open."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Awaitable

import pytest
from limits.aio.storage import RedisStorage

from conftest import REDIS_URL, service_unavailable
from ivy_sandbox.config import Settings
from ivy_sandbox.errors import RateLimited, RateLimitState
from ivy_sandbox.ratelimit import RateLimiter, make_storage, rate_limit_headers
from ivy_sandbox.ratelimit_memory import InProcessStorage

HIGH = "1000/minute"


@pytest.fixture
async def memory_limiter() -> AsyncIterator[RateLimiter]:
    limiter = RateLimiter(make_storage(None), per_user="3/minute", per_chat="2/minute", **_auth(2))
    yield limiter
    await limiter.aclose()


def _auth(n: int) -> dict[str, str]:
    return {"auth_failures": f"{n}/minute"}


async def tripped(call: Awaitable[None]) -> RateLimitState:
    with pytest.raises(RateLimited) as info:
        await call
    return info.value.state


# -- headers -----------------------------------------------------------------------------------
def test_rate_limit_headers_follow_the_ietf_draft_structured_fields() -> None:
    headers = rate_limit_headers(RateLimitState("user", 600, 60, 0, 12))
    assert headers == {
        "Retry-After": "12",
        "RateLimit-Policy": '"user";q=600;w=60',
        "RateLimit": '"user";r=0;t=12',
    }


def test_rate_limit_headers_name_the_policy_that_tripped() -> None:
    headers = rate_limit_headers(RateLimitState("auth-failures", 60, 3600, 5, 1))
    assert headers["RateLimit-Policy"] == '"auth-failures";q=60;w=3600'
    assert headers["RateLimit"] == '"auth-failures";r=5;t=1'
    assert headers["Retry-After"] == "1"


# -- storage -----------------------------------------------------------------------------------
def test_make_storage_without_url_is_in_memory() -> None:
    assert isinstance(make_storage(None), InProcessStorage)


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1:6379/0", "rediss://cache.example:6380/1", "redis://:pw@h:1/2"]
)
def test_make_storage_with_a_redis_url_is_redis(url: str) -> None:
    assert isinstance(make_storage(url), RedisStorage)


def test_make_storage_accepts_every_redis_url_the_settings_accept() -> None:
    url = Settings(redis_url="unix:///run/redis/redis.sock").redis_url
    assert url is not None
    assert isinstance(make_storage(url), RedisStorage)


@pytest.mark.redis
async def test_redis_storage_counters_are_shared_by_prefix_and_separated_between_prefixes() -> None:
    if not REDIS_URL:
        service_unavailable("IVY_TEST_REDIS_URL is not set (no Redis for this run)")
    prefix = f"ivy-test-{uuid.uuid4().hex}"

    def limiter(key_prefix: str) -> RateLimiter:
        return RateLimiter(
            make_storage(REDIS_URL, key_prefix=key_prefix),
            per_user="2/minute",
            per_chat=HIGH,
            **_auth(2),
        )

    first, same_prefix, other_prefix = limiter(prefix), limiter(prefix), limiter(prefix + "-x")
    await first.check_user("user_alice")
    await same_prefix.check_user("user_alice")
    assert (await tripped(first.check_user("user_alice"))).policy_name == "user"
    await other_prefix.check_user("user_alice")


# -- policies ----------------------------------------------------------------------------------
def test_policies_parse_limits_notation_into_named_amounts_and_windows() -> None:
    limiter = RateLimiter(
        InProcessStorage(), per_user="600/minute", per_chat="2 per second", auth_failures="60/hour"
    )
    got = {
        p.name: (p.item.amount, p.window_seconds)
        for p in (limiter.user, limiter.chat, limiter.auth_failures)
    }
    assert got == {"user": (600, 60), "chat": (2, 1), "auth-failures": (60, 3600)}
    five_minutes = RateLimiter(
        InProcessStorage(), per_user="10/5 minutes", per_chat=HIGH, **_auth(1)
    )
    assert five_minutes.user.window_seconds == 300


@pytest.mark.parametrize("bad", ["lots", "", "-1/minute", "5/fortnight"])
def test_policies_reject_text_that_is_not_limits_notation(bad: str) -> None:
    with pytest.raises(ValueError, match=r"parse|granularity"):
        RateLimiter(InProcessStorage(), per_user=bad, per_chat=HIGH, auth_failures=HIGH)


# -- behaviour on memory storage ---------------------------------------------------------------
async def test_chat_limit_raises_rate_limited_with_the_state_clients_need(
    memory_limiter: RateLimiter,
) -> None:
    await memory_limiter.check_chat("user_alice", "chat_a")
    await memory_limiter.check_chat("user_alice", "chat_a")
    state = await tripped(memory_limiter.check_chat("user_alice", "chat_a"))
    assert (state.policy_name, state.limit, state.window_seconds, state.remaining) == (
        "chat",
        2,
        60,
        0,
    )
    assert 1 <= state.reset_seconds <= 60


async def test_chat_counters_are_per_user_and_chat(memory_limiter: RateLimiter) -> None:
    for _ in range(2):
        await memory_limiter.check_chat("user_alice", "chat_a")
    await tripped(memory_limiter.check_chat("user_alice", "chat_a"))
    await memory_limiter.check_chat("user_alice", "chat_b")
    await memory_limiter.check_chat("user_bob", "chat_a")


async def test_the_three_policies_count_separately_for_the_same_identifier(
    memory_limiter: RateLimiter,
) -> None:
    for _ in range(2):
        await memory_limiter.record_auth_failure("x")
    assert (await tripped(memory_limiter.record_auth_failure("x"))).policy_name == "auth-failures"
    await memory_limiter.check_user("x")
    await memory_limiter.check_chat("x", "x")
    await memory_limiter.record_auth_failure("y")


async def test_user_limit_trips_after_its_amount(memory_limiter: RateLimiter) -> None:
    for _ in range(3):
        await memory_limiter.check_user("user_alice")
    state = await tripped(memory_limiter.check_user("user_alice"))
    assert (state.policy_name, state.limit) == ("user", 3)
    await memory_limiter.check_user("user_bob")


async def test_unreachable_redis_fails_open_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    limiter = RateLimiter(
        make_storage("redis://127.0.0.1:1/0", key_prefix=uuid.uuid4().hex),
        per_user="1/minute",
        per_chat="1/minute",
        auth_failures="1/minute",
    )
    with caplog.at_level(logging.ERROR, logger="ivy_sandbox.ratelimit"):
        for _ in range(3):
            await limiter.check_user("user_alice")
            await limiter.check_chat("user_alice", "chat_a")
            await limiter.record_auth_failure("203.0.113.7")
    assert sum("rate limiter storage failed" in r.getMessage() for r in caplog.records) == 9

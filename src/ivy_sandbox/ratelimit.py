"""Rate limits (the `limits` library): per user, per (user, chat), launches per user, and
failed logins per IP.

Sliding-window counters: cheap (two counters per key), smooth at window edges. With Redis
(shared by replicas) through ``limits``; in one process through ``ratelimit_memory``, the same
algorithm without the library's per-call overhead (measured there).

Headers follow the IETF draft ``draft-ietf-httpapi-ratelimit-headers`` (structured fields):
``RateLimit-Policy: "user";q=600;w=60`` and ``RateLimit: "user";r=0;t=12``, plus
``Retry-After: 12``. They are sent with 429 responses.

If Redis is unreachable the limiter *fails open* (the request proceeds, the error is logged):
an outage of the shared counter should not take the API down with it.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import NoReturn

from limits import RateLimitItem, parse
from limits.aio.storage import RedisStorage, Storage
from limits.aio.strategies import SlidingWindowCounterRateLimiter

from ivy_sandbox.domain.ids import is_acceptable_id
from ivy_sandbox.errors import RateLimited, RateLimitState
from ivy_sandbox.ratelimit_memory import InProcessStorage, SlidingWindows

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Policy:
    name: str
    item: RateLimitItem

    @property
    def window_seconds(self) -> int:
        return int(self.item.get_expiry())


def make_storage(
    redis_url: str | None, key_prefix: str = "ivy-sandbox"
) -> Storage | InProcessStorage:
    if redis_url is None:
        return InProcessStorage()
    scheme, _, rest = redis_url.partition("://")
    async_scheme = {"redis": "async+redis", "rediss": "async+rediss", "unix": "async+redis+unix"}
    uri = f"{async_scheme[scheme]}://{rest}"
    return RedisStorage(uri, implementation="redispy", key_prefix=key_prefix)


class RateLimiter:
    """The three policies of the API, checked with :meth:`check_*`; each raises RateLimited."""

    def __init__(
        self,
        storage: Storage | InProcessStorage,
        *,
        per_user: str,
        per_chat: str,
        auth_failures: str,
        per_launch: str = "30/minute",
    ) -> None:
        self.storage = storage
        self.user = Policy("user", parse(per_user))
        self.chat = Policy("chat", parse(per_chat))
        self.auth_failures = Policy("auth-failures", parse(auth_failures))
        self.launch = Policy("launch", parse(per_launch))
        self._limiter: SlidingWindowCounterRateLimiter | None = None
        self._local: dict[str, SlidingWindows] = {}
        if isinstance(storage, InProcessStorage):
            for policy in (self.user, self.chat, self.auth_failures, self.launch):
                self._local[policy.name] = storage.windows(
                    policy.name, policy.item.amount, policy.window_seconds
                )
        else:
            self._limiter = SlidingWindowCounterRateLimiter(storage)

    async def check_user(self, user_id: str) -> None:
        await self._hit(self.user, "u", user_id)

    async def check_chat(self, user_id: str, chat_id: str) -> None:
        # Malformed ids share one counter, so junk cannot grow the limiter's key space.
        await self._hit(self.chat, "c", user_id, chat_id if is_acceptable_id(chat_id) else "~")

    async def check_launch(self, user_id: str) -> None:
        """Launches start real processes: a smaller budget on top of the per-user one."""
        await self._hit(self.launch, "l", user_id)

    async def record_auth_failure(self, client_ip: str) -> None:
        """Count a failed authentication; raise RateLimited once the IP is over its limit."""
        await self._hit(self.auth_failures, "f", client_ip)

    async def _hit(self, policy: Policy, *identifiers: str) -> None:
        if self._limiter is None:
            windows = self._local[policy.name]
            if windows.hit(identifiers):
                return
            local = windows.stats(identifiers)
            self._refuse(policy, local.remaining, local.reset_in)
        try:
            allowed = await self._limiter.hit(policy.item, *identifiers)
            if allowed:
                return
            stats = await self._limiter.get_window_stats(policy.item, *identifiers)
        except Exception:  # fail open: see module docstring
            log.exception("rate limiter storage failed; allowing the request")
            return
        self._refuse(policy, stats.remaining, stats.reset_time - time.time())

    @staticmethod
    def _refuse(policy: Policy, remaining: int, reset_in: float) -> NoReturn:
        reset = max(1, math.ceil(reset_in))
        raise RateLimited(
            RateLimitState(
                policy_name=policy.name,
                limit=policy.item.amount,
                window_seconds=policy.window_seconds,
                remaining=max(0, remaining),
                reset_seconds=min(reset, policy.window_seconds),
            )
        )

    async def aclose(self) -> None:
        if isinstance(self.storage, InProcessStorage):
            self.storage.reset()


def rate_limit_headers(state: RateLimitState) -> dict[str, str]:
    """The 429 headers for ``state``."""
    return {
        "Retry-After": str(state.reset_seconds),
        "RateLimit-Policy": f'"{state.policy_name}";q={state.limit};w={state.window_seconds}',
        "RateLimit": f'"{state.policy_name}";r={state.remaining};t={state.reset_seconds}',
    }

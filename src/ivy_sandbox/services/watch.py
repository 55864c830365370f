"""Watching a sandbox without waste: Server-Sent Events and long-poll on the status endpoint.

Both speak the seed's status body and nothing else. A watcher subscribes to the chat on the
event bus *before* reading the status (so a change between the read and the subscription is
never missed), sleeps without holding a database connection, and on every wake-up reads the
status again from the database — the event only says "look again". A periodic re-check
bounds the delay when an event cannot arrive (a worker in another process on SQLite).

What counts as a change: status, phase, error message, creation time (a relaunch), or the
ETA appearing or disappearing (a queued launch admitted) — not the ETA's count-down, which
clients can do alone, nor its re-estimation, which happens with a phase change anyway.

A credential can stop being valid while its watch is open (an API key revoked or expired, a
session token past ``exp``). Both kinds of watch therefore check it again every
``keepalive_seconds`` (``IVY_WATCH_KEEPALIVE_SECONDS``, 15 s by default) with the same
``still_authenticated`` callable the route passes in — the ordinary authentication, cached,
so a check is a dictionary lookup most of the time and at most one key read per 5 s per key
(the cost of the 1 Hz poll a watch replaces). A revocation therefore ends a watch within
about ``keepalive_seconds`` + 5 s (the key cache); a session token within ``keepalive_seconds``
of its ``exp`` + 5 s leeway. What the client gets when the check fails:

- SSE: the stream has already answered 200, so it sends ``event: error`` with
  ``data: {"code":"unauthenticated"}`` and ends; a client must not reconnect with the same
  credential (it would get the ordinary 401).
- Long-poll: nothing has been sent yet, so it answers exactly what the same request would get
  now — the ordinary 401 ``unauthenticated`` problem body with ``WWW-Authenticate`` — rather
  than a 200 read with a credential that no longer works. A change that arrives before the
  next check is answered 200 as usual (the credential was valid at the last check).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from ivy_sandbox.auth.principal import Principal
from ivy_sandbox.domain.sandbox import SandboxSnapshot, StatusBody, rfc3339, status_body
from ivy_sandbox.errors import AuthenticationFailed, PermissionDenied
from ivy_sandbox.events import EventBus
from ivy_sandbox.ratelimit import RateLimiter
from ivy_sandbox.services.clock import Clock
from ivy_sandbox.services.sandboxes import authorize_chat
from ivy_sandbox.storage.repository import Repository

MAX_WAIT_SECONDS = 60
KEEPALIVE_SECONDS = 15.0
TERMINAL = frozenset({"active", "failed", "none"})


@dataclass(frozen=True)
class Watching:
    repository: Repository
    bus: EventBus
    limiter: RateLimiter
    clock: Clock
    recheck_seconds: float  # how often to look even without an event

    async def charge(self, principal: Principal, chat_id: str) -> None:
        """A watch costs one request against the per-chat limit, like a status poll."""
        await self.limiter.check_chat(principal.user_id, chat_id)


def state_token(snapshot: SandboxSnapshot | None) -> str:
    """An opaque token that changes exactly when a watcher should be told (see module doc)."""
    if snapshot is None:
        return "none"
    parts = (
        snapshot.status.value,
        snapshot.phase.value,
        snapshot.error_message or "",
        rfc3339(snapshot.created_at),  # a relaunch after failure is a new sandbox
        "eta" if snapshot.eta_seconds is not None else "",  # queued → admitted
    )
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:16]


async def _read(
    watching: Watching, principal: Principal, chat_id: str
) -> tuple[SandboxSnapshot | None, str]:
    access = await authorize_chat(watching.repository, principal, chat_id)
    return access.sandbox, state_token(access.sandbox)


def _seconds_until(watching: Watching, deadline: float) -> float:
    """How long to sleep to be awake by ``deadline``, and to look again at least every
    ``recheck_seconds``. Sleeping towards a fixed deadline (not a fresh interval after every
    wake-up) is what keeps a keep-alive or credential check on time when events arrive that
    change nothing visible: restarting the interval made them up to twice as late."""
    return max(0.0, min(deadline - watching.clock.monotonic(), watching.recheck_seconds))


async def wait_for_change(
    watching: Watching,
    principal: Principal,
    chat_id: str,
    *,
    since: str | None,
    wait_seconds: float,
    still_authenticated: Callable[[], Awaitable[object]] | None = None,
    keepalive_seconds: float = KEEPALIVE_SECONDS,
) -> tuple[StatusBody, str]:
    """Long-poll: the status as soon as it differs from ``since`` (or now), else after
    ``wait_seconds``. Always the current body; never an error for waiting too long.

    While waiting, ``still_authenticated`` is called every ``keepalive_seconds``; the
    :class:`AuthenticationFailed` it raises when the credential stopped being valid ends the
    wait (the route answers it as the ordinary 401)."""
    await watching.charge(principal, chat_id)
    async with watching.bus.subscribe(chat_id) as subscription:
        snapshot, token = await _read(watching, principal, chat_id)
        baseline = since if since is not None else token
        clock = watching.clock
        answer_by = clock.monotonic() + min(wait_seconds, MAX_WAIT_SECONDS)
        check_due = clock.monotonic() + keepalive_seconds
        while token == baseline and clock.monotonic() < answer_by:
            due = answer_by if still_authenticated is None else min(answer_by, check_due)
            await subscription.wait(_seconds_until(watching, due))
            if still_authenticated is not None and clock.monotonic() >= check_due:
                await still_authenticated()  # AuthenticationFailed ends the wait: a 401
                check_due = clock.monotonic() + keepalive_seconds
            snapshot, token = await _read(watching, principal, chat_id)
    return status_body(snapshot, watching.clock.now()), token


def sse_event(body: StatusBody, token: str) -> str:
    data = json.dumps(body, separators=(",", ":"))
    return f"id: {token}\nevent: status\ndata: {data}\n\n"


async def status_stream(
    watching: Watching,
    principal: Principal,
    chat_id: str,
    *,
    still_authenticated: Callable[[], Awaitable[object]],
    keepalive_seconds: float = KEEPALIVE_SECONDS,
) -> AsyncIterator[str]:  # a coroutine returning the stream: errors come before any byte
    """SSE: the current status, then one event per change, keep-alive comments while
    nothing changes; ends after active, failed or none — or when the credential stops
    being valid (checked at every keep-alive) or the chat stops being visible.

    Authorization and rate limiting happen before the first byte, so a refused stream is
    an ordinary 403/429 response, not an event."""
    await watching.charge(principal, chat_id)
    await authorize_chat(watching.repository, principal, chat_id)
    return _stream(watching, principal, chat_id, still_authenticated, keepalive_seconds)


async def _stream(
    watching: Watching,
    principal: Principal,
    chat_id: str,
    still_authenticated: Callable[[], Awaitable[object]],
    keepalive_seconds: float,
) -> AsyncIterator[str]:
    async with watching.bus.subscribe(chat_id) as subscription:
        # Read after subscribing: no change can fall between the read and the subscription.
        snapshot, token = await _read(watching, principal, chat_id)
        yield "retry: 2000\n\n"
        while True:
            body = status_body(snapshot, watching.clock.now())
            yield sse_event(body, token)
            if body["status"] in TERMINAL:
                return
            sent = token
            # Measured from the last write: a wake-up that changed nothing must not restart it.
            keepalive_due = watching.clock.monotonic() + keepalive_seconds
            while token == sent:
                await subscription.wait(_seconds_until(watching, keepalive_due))
                if watching.clock.monotonic() >= keepalive_due:
                    try:
                        await still_authenticated()
                    except AuthenticationFailed:
                        yield 'event: error\ndata: {"code":"unauthenticated"}\n\n'
                        return
                    yield ": keep-alive\n\n"
                    keepalive_due = watching.clock.monotonic() + keepalive_seconds
                try:
                    snapshot, token = await _read(watching, principal, chat_id)
                except PermissionDenied:
                    yield 'event: error\ndata: {"code":"forbidden"}\n\n'
                    return

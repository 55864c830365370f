"""A credential that stops being valid ends the watches already open with it (real server).

One ``ivy-sandbox serve`` (SQLite, latency-fake backend, ``IVY_MAX_SANDBOXES=1``). Another
user's sandbox takes the only slot, so every watched launch stays ``provisioning`` (queued for
capacity) for as long as a test needs. Credentials are re-checked every
``IVY_WATCH_KEEPALIVE_SECONDS`` (0.5 s here instead of 15 s).

- a key revoked with the admin CLI (another process: this one notices when its 5 s key cache
  lets go) ends an open SSE stream with ``event: error`` / ``unauthenticated`` and a waiting
  long-poll with the ordinary 401;
- a key revoked through the API (``DELETE /v1/api-keys/{id}`` with a Clerk session) does the
  same, at the next check;
- a Clerk session token that expires (``exp`` + 5 s leeway) ends an SSE stream and a
  long-poll opened with it.

Bounds are loop limits, never speed assertions: the long-polls ask for 60 s, the SSE streams
would run for minutes, so an end within the bound can only come from the re-check.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from serve_process import Account, Server, new_account, started_server

from ivy_sandbox.auth.api_keys import parse_api_key

KEEPALIVE = 0.5
BOUND = 30.0  # generous: 0.5 s cadence + 5 s key cache (+ 5 s leeway for sessions)
LONG_POLL_WAIT = 60
SESSION_LIFETIME = 1  # seconds until `exp` of the short-lived session token


@dataclass(frozen=True)
class Clerk:
    private_key: rsa.RSAPrivateKey

    def session(self, user: str, lifetime: float = 600) -> str:
        now = int(time.time())
        claims = {
            "sub": user,
            "sid": f"sess_{uuid.uuid4().hex[:12]}",
            "iat": now - 1,
            "nbf": now - 1,
            "exp": now + int(lifetime),
        }
        return jwt.encode(claims, self.private_key, algorithm="RS256", headers={"typ": "JWT"})


@pytest.fixture(scope="module")
def clerk() -> Clerk:
    return Clerk(rsa.generate_private_key(public_exponent=65537, key_size=2048))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, clerk: Clerk) -> Iterator[Server]:
    pem = (
        clerk.private_key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )
    running = started_server(
        tmp_path_factory.mktemp("revocation"),
        {
            "IVY_SANDBOX_BACKEND": "latency-fake",
            "IVY_MAX_SANDBOXES": "1",
            "IVY_WATCH_KEEPALIVE_SECONDS": str(KEEPALIVE),
            "IVY_CLERK_JWT_KEY": pem,
        },
    )
    try:
        occupy_the_only_slot(running, clerk)
        yield running
    finally:
        running.stop()


def occupy_the_only_slot(server: Server, clerk: Clerk) -> None:
    """Another user's sandbox, launched and active: later launches queue behind it."""
    blocker = api_account(server, clerk)
    headers = {"X-Ivy-Api-Key": blocker.key}
    url = f"{server.base_url}/v1/sandbox/{blocker.chat}"
    assert httpx.post(url, headers=headers).status_code == 202
    deadline = time.monotonic() + BOUND
    while time.monotonic() < deadline:
        body = httpx.get(f"{url}/status", headers=headers).json()
        if body["status"] == "active":
            return
        if body["status"] == "failed":
            pytest.fail(f"the blocking sandbox failed: {body}\n{server.logs()}")
        time.sleep(0.5)  # inside the per-chat limit (120/min) for the whole bound
    pytest.fail(f"the blocking sandbox never became active\n{server.logs()}")


def api_account(server: Server, clerk: Clerk) -> Account:
    """A user (created by its first session token), a chat and a key, all through the API."""
    user = f"user_{uuid.uuid4().hex[:10]}"
    session = {"Authorization": f"Bearer {clerk.session(user)}"}
    chat = httpx.post(f"{server.base_url}/v1/chats", headers=session, json={})
    assert chat.status_code == 201, chat.text
    key = httpx.post(f"{server.base_url}/v1/api-keys", headers=session, json={})
    assert key.status_code == 201, key.text
    return Account(user, chat.json()["id"], key.json()["key"])


def queued_launch(server: Server, account: Account) -> None:
    """Launch the account's chat and wait until it is queued: it then stays provisioning (no
    capacity) for minutes, with nothing about it changing."""
    response = httpx.post(
        f"{server.base_url}/v1/sandbox/{account.chat}", headers={"X-Ivy-Api-Key": account.key}
    )
    assert response.status_code == 202, response.text
    assert response.json()["status"] == "provisioning"
    # The launch is visibly queued once the worker has found no capacity and dropped its
    # ETA; before that the watches below would (rightly) answer that change.
    status = f"{server.base_url}/v1/sandbox/{account.chat}/status"
    deadline = time.monotonic() + BOUND
    while time.monotonic() < deadline:
        body = httpx.get(status, headers={"X-Ivy-Api-Key": account.key}).json()
        assert body["status"] == "provisioning", body
        if "etaSeconds" not in body:
            return
        time.sleep(0.1)
    pytest.fail(f"the launch was never queued for capacity\n{server.logs()}")


@dataclass
class Stream:
    """What an SSE client saw: status events, keep-alives, the error event, how it ended."""

    statuses: list[dict[str, object]]
    keepalives: int
    error: dict[str, object] | None = None
    ended: bool = False


async def watch_events(
    client: httpx.AsyncClient, url: str, headers: dict[str, str], opened: asyncio.Event
) -> Stream:
    seen = Stream(statuses=[], keepalives=0)
    async with client.stream("GET", url, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        event = ""
        async for line in response.aiter_lines():
            if line.startswith(": keep-alive"):
                seen.keepalives += 1
                if seen.statuses:
                    opened.set()  # the first check passed: the credential was valid
            elif line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                if event == "status":
                    seen.statuses.append(data)
                elif event == "error":
                    seen.error = data
    seen.ended = True
    return seen


async def long_poll(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> httpx.Response:
    return await client.get(url, headers=headers | {"Prefer": f"wait={LONG_POLL_WAIT}"})


async def watch_both_then(
    server: Server, chat: str, headers: dict[str, str], invalidate: object
) -> tuple[Stream, httpx.Response]:
    """Open an SSE stream and a long-poll, wait until both are established and the stream
    has passed a credential check, run ``invalidate`` (a blocking callable), and collect how
    each ended (within the bound)."""
    base = f"{server.base_url}/v1/sandbox/{chat}"
    timeout = httpx.Timeout(BOUND, connect=10)
    async with httpx.AsyncClient(timeout=timeout) as client:
        opened = asyncio.Event()
        stream = asyncio.create_task(watch_events(client, f"{base}/events", headers, opened))
        poll = asyncio.create_task(long_poll(client, f"{base}/status", headers))
        await asyncio.wait_for(opened.wait(), BOUND)
        await asyncio.sleep(2 * KEEPALIVE)  # the long-poll has passed a check too
        assert not stream.done(), "the stream ended before the credential was invalidated"
        assert not poll.done(), "the long-poll answered before the credential was invalidated"
        assert callable(invalidate)
        await asyncio.to_thread(invalidate)
        seen, response = await asyncio.wait_for(asyncio.gather(stream, poll), BOUND)
    return seen, response


def assert_ended_unauthenticated(seen: Stream, response: httpx.Response) -> None:
    assert seen.ended
    assert seen.error == {"code": "unauthenticated"}
    assert seen.statuses, "the stream sent the current status first"
    assert all(s["status"] == "provisioning" for s in seen.statuses)
    assert response.status_code == 401, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert response.headers["www-authenticate"] == 'Bearer realm="ivy", error="invalid_token"'
    assert response.json()["code"] == "unauthenticated"


def assert_reconnecting_is_refused(server: Server, chat: str, headers: dict[str, str]) -> None:
    for suffix in ("status", "events"):
        again = httpx.get(f"{server.base_url}/v1/sandbox/{chat}/{suffix}", headers=headers)
        assert again.status_code == 401, (suffix, again.text)


async def test_a_key_revoked_with_the_admin_cli_ends_the_open_stream_and_long_poll(
    server: Server,
) -> None:
    account = await asyncio.to_thread(new_account, server)
    await asyncio.to_thread(queued_launch, server, account)
    headers = {"Authorization": f"Bearer {account.key}"}
    kid = parse_api_key(account.key).kid

    seen, response = await watch_both_then(
        server, account.chat, headers, lambda: server.admin("keys", "revoke", kid)
    )
    assert_ended_unauthenticated(seen, response)
    assert_reconnecting_is_refused(server, account.chat, headers)


async def test_a_key_revoked_through_the_api_ends_the_open_stream_and_long_poll(
    server: Server, clerk: Clerk
) -> None:
    account = await asyncio.to_thread(api_account, server, clerk)
    await asyncio.to_thread(queued_launch, server, account)
    headers = {"X-Ivy-Api-Key": account.key}
    kid = parse_api_key(account.key).kid
    session = {"Authorization": f"Bearer {clerk.session(account.user)}"}

    def revoke() -> None:
        response = httpx.delete(f"{server.base_url}/v1/api-keys/{kid}", headers=session)
        assert response.status_code == 204, response.text

    seen, response = await watch_both_then(server, account.chat, headers, revoke)
    assert_ended_unauthenticated(seen, response)
    assert_reconnecting_is_refused(server, account.chat, headers)


async def test_a_session_token_that_expires_ends_the_open_stream_and_long_poll(
    server: Server, clerk: Clerk
) -> None:
    account = await asyncio.to_thread(api_account, server, clerk)
    await asyncio.to_thread(queued_launch, server, account)
    headers = {"Authorization": f"Bearer {clerk.session(account.user, SESSION_LIFETIME)}"}

    # Nothing to do but wait: the token dies on its own at `exp` + 5 s leeway.
    seen, response = await watch_both_then(server, account.chat, headers, lambda: None)
    assert_ended_unauthenticated(seen, response)
    assert_reconnecting_is_refused(server, account.chat, headers)

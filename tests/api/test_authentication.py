"""Authentication through the HTTP API: every credential form, every way it can be bad.

One 401 body for every cause; ``WWW-Authenticate`` says ``invalid_token`` only when a
credential was sent.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable
from datetime import timedelta

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from limits.aio.storage import RedisStorage
from sqlalchemy import select

from conftest import REDIS_URL, TokenFactory, World
from fakes import FakeClock
from ivy_sandbox.auth.api_keys import generate_api_key
from ivy_sandbox.bootstrap import Services
from ivy_sandbox.ratelimit_memory import InProcessStorage
from ivy_sandbox.storage.tables import api_keys, users

UNAUTHENTICATED_BODY = (
    b'{"type":"urn:ivy-sandbox:error:unauthenticated","title":"Unauthorized","status":401,'
    b'"detail":"Authentication required: send a valid API key or session token.",'
    b'"code":"unauthenticated"}'
)

Send = Callable[[str, dict[str, str]], Awaitable[httpx.Response]]


@pytest.fixture
def send(client: httpx.AsyncClient) -> Send:
    async def _send(chat_id: str, headers: dict[str, str]) -> httpx.Response:
        return await client.get(f"/v1/sandbox/{chat_id}/status", headers=headers)

    return _send


def assert_unauthenticated(response: httpx.Response, *, credential_sent: bool = True) -> None:
    assert response.status_code == 401
    assert response.content == UNAUTHENTICATED_BODY
    assert response.headers["content-type"] == "application/problem+json"
    expected = 'Bearer realm="ivy"' + (', error="invalid_token"' if credential_sent else "")
    assert response.headers["www-authenticate"] == expected


CREDENTIAL_FORMS: dict[str, Callable[[str], dict[str, str]]] = {
    "x-ivy-api-key": lambda c: {"X-Ivy-Api-Key": c},
    "bearer": lambda c: {"Authorization": f"Bearer {c}"},
    "bearer-lowercase-scheme": lambda c: {"Authorization": f"bearer  {c} "},
    "session-cookie": lambda c: {"Cookie": f"__session={c}"},
    "suffixed-session-cookie": lambda c: {"Cookie": f"other=1; __session_Ab12={c}"},
}
KEY_FORMS = ["x-ivy-api-key", "bearer", "bearer-lowercase-scheme"]
SESSION_FORMS = ["bearer", "bearer-lowercase-scheme", "session-cookie", "suffixed-session-cookie"]


# -- the valid paths -------------------------------------------------------------------------
@pytest.mark.parametrize("form", KEY_FORMS)
async def test_valid_api_key_is_accepted_in_every_header_form(
    send: Send, world: World, form: str
) -> None:
    key, chat = await world.key(), await world.chat()
    response = await send(chat, CREDENTIAL_FORMS[form](key))
    assert response.status_code == 200
    assert response.json() == {"status": "none"}


@pytest.mark.parametrize("form", SESSION_FORMS)
async def test_valid_session_token_is_accepted_in_header_and_cookie(
    send: Send, world: World, tokens: TokenFactory, form: str
) -> None:
    chat = await world.chat("user_alice")
    response = await send(chat, CREDENTIAL_FORMS[form](tokens.token("user_alice")))
    assert response.status_code == 200


async def test_first_valid_session_token_creates_the_user(
    send: Send, world: World, tokens: TokenFactory, services: Services
) -> None:
    response = await send("chat_any", {"Authorization": f"Bearer {tokens.token('user_new')}"})
    assert response.status_code == 403  # authenticated, but owns no such chat
    async with services.repository.engine.connect() as conn:
        found = (await conn.execute(select(users.c.id).where(users.c.id == "user_new"))).all()
    assert found == [("user_new",)]


async def test_one_session_writes_its_user_row_once_and_a_new_session_ensures_it_again(
    send: Send, tokens: TokenFactory, services: Services
) -> None:
    async def user_rows() -> list[tuple[str]]:
        async with services.repository.engine.begin() as conn:
            found = await conn.execute(select(users.c.id).where(users.c.id == "user_new"))
            return [tuple(row) for row in found.all()]

    first = {"Authorization": f"Bearer {tokens.token('user_new', sid='sess_first')}"}
    assert (await send("chat_any", first)).status_code == 403
    assert await user_rows() == [("user_new",)]
    async with services.repository.engine.begin() as conn:
        await conn.execute(users.delete().where(users.c.id == "user_new"))

    # The session is known: its polls write nothing (the row stays deleted).
    assert (await send("chat_any", first)).status_code == 403
    assert await user_rows() == []
    # A new session of the same user ensures the row again.
    second = {"Authorization": f"Bearer {tokens.token('user_new', sid='sess_second')}"}
    assert (await send("chat_any", second)).status_code == 403
    assert await user_rows() == [("user_new",)]


async def test_a_session_id_reused_by_another_user_gets_that_users_identity(
    send: Send, world: World, tokens: TokenFactory
) -> None:
    alice_chat = await world.chat("user_alice")
    alice = {"Authorization": f"Bearer {tokens.token('user_alice', sid='sess_same')}"}
    bob = {"Authorization": f"Bearer {tokens.token('user_bob', sid='sess_same')}"}
    assert (await send(alice_chat, alice)).status_code == 200
    assert (await send(alice_chat, bob)).status_code == 403
    assert (await send(alice_chat, alice)).status_code == 200


# -- the status-code matrix, form by form -----------------------------------------------------
# Every way a caller can present a credential: (form in CREDENTIAL_FORMS, kind of credential).
# 403 for each form: test_authorization.py; 429 for each form: test_rate_limits.py.
MATRIX_FORMS = {
    "x-ivy-api-key": ("x-ivy-api-key", "key"),
    "bearer-api-key": ("bearer", "key"),
    "bearer-session-jwt": ("bearer", "session"),
    "session-cookie-jwt": ("session-cookie", "session"),
    "suffixed-session-cookie-jwt": ("suffixed-session-cookie", "session"),
}


@pytest.mark.parametrize("name", list(MATRIX_FORMS))
async def test_each_credential_form_gets_200_for_its_chat_and_the_uniform_401_when_bad(
    send: Send,
    world: World,
    tokens: TokenFactory,
    services: Services,
    clock: FakeClock,
    other_rsa_key: rsa.RSAPrivateKey,
    name: str,
) -> None:
    form, kind = MATRIX_FORMS[name]
    chat = await world.chat("user_alice")
    await world.sandbox(chat, "active", "ready", ready_at=clock.now())
    now = int(clock.time())
    if kind == "key":
        good = await world.key("user_alice")
        revoked = await world.key("user_alice")
        await services.repository.revoke_api_key(revoked.split("_")[1], clock.now())
        bad = {"bad-checksum": _flip_last_char(good), "revoked": revoked}
    else:
        good = tokens.token("user_alice")
        bad = {
            "expired": tokens.token(exp=now - 60, iat=now - 120, nbf=now - 120),
            "signed-by-another-key": tokens.token(key=other_rsa_key),
        }

    ok = await send(chat, CREDENTIAL_FORMS[form](good))
    assert ok.status_code == 200, ok.text
    assert ok.json()["status"] == "active"
    assert ok.headers["cache-control"] == "no-store"
    assert "www-authenticate" not in ok.headers
    for label, credential in bad.items():
        response = await send(chat, CREDENTIAL_FORMS[form](credential))
        assert response.status_code == 401, label
        assert_unauthenticated(response)
    # The same request without the credential: 401, and no invalid_token (nothing was sent).
    assert_unauthenticated(await send(chat, {}), credential_sent=False)


async def test_api_tests_pair_sqlite_with_memory_and_postgres_with_the_shared_limiter(
    services: Services, database_url: str, limiter_storage_url: str | None
) -> None:
    """The app under every API test counts on the storage paired with its database."""
    if database_url.startswith("sqlite"):
        assert limiter_storage_url is None
        assert isinstance(services.limiter.storage, InProcessStorage)
    elif REDIS_URL:
        assert limiter_storage_url == REDIS_URL
        assert isinstance(services.limiter.storage, RedisStorage)


# -- no credential / unsupported forms --------------------------------------------------------
async def test_request_without_credentials_gets_401_without_invalid_token(send: Send) -> None:
    assert_unauthenticated(await send("chat_x", {}), credential_sent=False)


async def test_unrelated_cookies_count_as_no_credentials(send: Send) -> None:
    response = await send("chat_x", {"Cookie": "theme=dark; __client_uat=1"})
    assert_unauthenticated(response, credential_sent=False)


@pytest.mark.parametrize(
    "authorization",
    ["Basic dXNlcjpwYXNz", "Bearer", "Bearer    ", "Token ivy_abc", "ivy_abc", ""],
)
async def test_malformed_authorization_header_gets_the_uniform_401(
    send: Send, authorization: str
) -> None:
    assert_unauthenticated(await send("chat_x", {"Authorization": authorization}))


# -- bad API keys ----------------------------------------------------------------------------
def _flip_last_char(key: str) -> str:
    return key[:-1] + ("A" if key[-1] != "A" else "B")


@pytest.mark.parametrize("form", KEY_FORMS)
async def test_every_kind_of_bad_api_key_gets_the_same_401(
    send: Send, world: World, services: Services, clock: FakeClock, form: str
) -> None:
    chat = await world.chat()
    good = await world.key()
    revoked = await world.key()
    kid = revoked.split("_")[1]
    await services.repository.revoke_api_key(kid, clock.now())
    expired = await world.key(expires_in=timedelta(seconds=10))
    unknown = generate_api_key().raw  # well-formed, valid checksum, never stored
    wrong_secret = _rebuild_with_kid(good, unknown)
    bad_keys = {
        "bad-checksum": _flip_last_char(good),
        "truncated": good[:-3],
        "wrong-prefix": "ivx" + good[3:],
        "revoked": revoked,
        "unknown-kid": unknown,
        "known-kid-wrong-secret": wrong_secret,
        "garbage": "ivy_!!!",
    }
    clock.advance(11)
    bad_keys["expired"] = expired
    for name, bad in bad_keys.items():
        response = await send(chat, CREDENTIAL_FORMS[form](bad))
        assert response.status_code == 401, name
        assert_unauthenticated(response)


def _rebuild_with_kid(owner_key: str, other_key: str) -> str:
    """A well-formed key (valid checksum) with ``owner_key``'s kid but another secret."""
    import zlib

    from ivy_sandbox.auth import api_keys as module

    kid = owner_key.split("_")[1]
    secret = other_key.split("_")[2][:30]
    signed = f"ivy_{kid}_{secret}"
    checksum = module._checksum(signed)
    assert zlib.crc32(signed.encode())  # the helper is the real checksum, not a copy
    return signed + checksum


async def test_revoked_key_keeps_working_only_until_the_five_second_cache_expires(
    send: Send, world: World, services: Services, clock: FakeClock
) -> None:
    key, chat = await world.key(), await world.chat()
    headers = {"X-Ivy-Api-Key": key}
    assert (await send(chat, headers)).status_code == 200
    await services.repository.revoke_api_key(key.split("_")[1], clock.now())
    clock.advance(4.9)
    assert (await send(chat, headers)).status_code == 200  # cached: the documented window
    clock.advance(0.2)
    assert_unauthenticated(await send(chat, headers))


async def test_cached_key_stops_working_the_moment_it_expires(
    send: Send, world: World, clock: FakeClock
) -> None:
    key = await world.key(expires_in=timedelta(seconds=2))
    chat = await world.chat()
    assert (await send(chat, {"X-Ivy-Api-Key": key})).status_code == 200
    clock.advance(2)
    assert_unauthenticated(await send(chat, {"X-Ivy-Api-Key": key}))


async def test_last_used_is_written_at_most_once_a_minute(
    send: Send, world: World, services: Services, clock: FakeClock
) -> None:
    key, chat = await world.key(), await world.chat()
    kid = key.split("_")[1]

    async def last_used() -> object:
        async with services.repository.engine.connect() as conn:
            query = select(api_keys.c.last_used_at).where(api_keys.c.id == kid)
            return (await conn.execute(query)).scalar_one()

    assert await last_used() is None
    await send(chat, {"X-Ivy-Api-Key": key})
    first = await last_used()
    assert first == clock.now()
    clock.advance(30)  # past the 5 s cache: the database is consulted, but not written
    await send(chat, {"X-Ivy-Api-Key": key})
    assert await last_used() == first
    clock.advance(31)
    await send(chat, {"X-Ivy-Api-Key": key})
    assert await last_used() == clock.now()


async def test_conflicting_key_headers_are_rejected(send: Send, world: World) -> None:
    key, other, chat = await world.key(), await world.key(), await world.chat()
    response = await send(chat, {"X-Ivy-Api-Key": key, "Authorization": f"Bearer {other}"})
    assert_unauthenticated(response)
    same = await send(chat, {"X-Ivy-Api-Key": key, "Authorization": f"Bearer {key}"})
    assert same.status_code == 200


# -- header wins over cookie -----------------------------------------------------------------
async def test_present_invalid_header_wins_over_a_valid_cookie(
    send: Send, world: World, tokens: TokenFactory
) -> None:
    chat = await world.chat()
    headers = {"Authorization": "Bearer not-a-token", "Cookie": f"__session={tokens.token()}"}
    assert_unauthenticated(await send(chat, headers))


async def test_valid_header_wins_over_an_invalid_cookie(send: Send, world: World) -> None:
    key, chat = await world.key(), await world.chat()
    headers = {"X-Ivy-Api-Key": key, "Cookie": "__session=garbage"}
    assert (await send(chat, headers)).status_code == 200


async def test_plain_session_cookie_wins_over_suffixed_ones(
    send: Send, world: World, tokens: TokenFactory
) -> None:
    chat = await world.chat()
    cookie = f"__session_x=garbage; __session={tokens.token()}"
    assert (await send(chat, {"Cookie": cookie})).status_code == 200


# -- session tokens, check by check ----------------------------------------------------------
@pytest.fixture
def other_rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _bad_tokens(tokens: TokenFactory, other: rsa.RSAPrivateKey) -> dict[str, str]:
    now = int(tokens.clock.time())
    return {
        "signed-by-another-key": tokens.token(key=other),
        "alg-hs256-with-pem-secret": _hs256_signed_with_pem(tokens),
        "alg-none": _unsigned(tokens),
        "expired-past-leeway": tokens.token(exp=now - 6, iat=now - 60, nbf=now - 60),
        "not-yet-valid": tokens.token(nbf=now + 30),
        "issued-in-the-future": tokens.token(iat=now + 30, nbf=None),
        "wrong-issuer": tokens.token(iss="https://evil.example"),
        "azp-not-allowed": tokens.token(azp="https://evil.example"),
        "azp-missing": tokens.token(azp=None),
        "pending-session": tokens.token(sts="pending"),
        "missing-sid": tokens.token(sid=None),
        "missing-exp": tokens.token(exp=None),
        "missing-iat": tokens.token(iat=None),
        "missing-sub": tokens.token(sub=None),
        "sub-not-a-user": tokens.token("mch_machine"),
        "oauth-access-token-typ": tokens.token(headers={"typ": "at+jwt"}),
        "jwt-template-category": tokens.token(headers={"cat": "cl_B7d4PD222AAA"}),
        "truncated": tokens.token()[:-10],
    }


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unsigned(tokens: TokenFactory) -> str:
    header = _b64(json.dumps({"alg": "none", "typ": "JWT"}).encode())
    return f"{header}.{_b64(json.dumps(tokens.claims()).encode())}."


def _hs256_signed_with_pem(tokens: TokenFactory) -> str:
    """The classic algorithm confusion: HMAC keyed with the public PEM text."""
    header = _b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "test-key"}).encode())
    signing_input = f"{header}.{_b64(json.dumps(tokens.claims()).encode())}"
    mac = hmac.new(tokens.public_pem.encode(), signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{_b64(mac)}"


@pytest.mark.parametrize("form", ["bearer", "session-cookie"])
async def test_every_invalid_session_token_gets_the_same_401(
    send: Send,
    world: World,
    tokens: TokenFactory,
    other_rsa_key: rsa.RSAPrivateKey,
    form: str,
) -> None:
    chat = await world.chat()
    assert (await send(chat, CREDENTIAL_FORMS[form](tokens.token()))).status_code == 200
    for name, bad in _bad_tokens(tokens, other_rsa_key).items():
        response = await send(chat, CREDENTIAL_FORMS[form](bad))
        assert response.status_code == 401, name
        assert_unauthenticated(response)


async def test_token_within_the_five_second_leeway_is_still_accepted(
    send: Send, world: World, tokens: TokenFactory
) -> None:
    chat = await world.chat()
    now = int(tokens.clock.time())
    token = tokens.token(exp=now - 3, iat=now - 60, nbf=now - 60)
    assert (await send(chat, {"Authorization": f"Bearer {token}"})).status_code == 200


async def test_cached_session_token_is_refused_once_expired(
    send: Send, world: World, tokens: TokenFactory, clock: FakeClock
) -> None:
    chat = await world.chat()
    token = tokens.token(exp=int(clock.time()) + 10)
    headers = {"Authorization": f"Bearer {token}"}
    assert (await send(chat, headers)).status_code == 200
    clock.advance(16)
    assert_unauthenticated(await send(chat, headers))


async def test_no_key_token_or_cookie_ever_appears_in_a_log_line(
    send: Send,
    world: World,
    tokens: TokenFactory,
    services: Services,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("DEBUG")
    chat = await world.chat()
    key = await world.key()
    revoked = await world.key()
    await services.repository.revoke_api_key(revoked.split("_")[1], clock.now())
    token = tokens.token()
    secrets = [key, revoked, _flip_last_char(key), token, token[:-5], "not-a-token"]
    for secret in secrets:
        for form in ("x-ivy-api-key", "bearer", "session-cookie"):
            await send(chat, CREDENTIAL_FORMS[form](secret))
            await send("chat_other", CREDENTIAL_FORMS[form](secret))
    assert caplog.records, "the requests above should have logged their 401s and 403s"
    logged = caplog.text
    for secret in secrets:
        assert secret not in logged
        assert secret[-20:] not in logged  # not even the secret's tail

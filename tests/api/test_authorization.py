"""Authorization: one decision (exists AND owned AND in scope), one 403 body for every cause."""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import TokenFactory, World

FORBIDDEN_BODY = (
    b'{"type":"urn:ivy-sandbox:error:forbidden","title":"Forbidden","status":403,'
    b'"detail":"You do not own this chat, or your key\'s project scope excludes it.",'
    b'"code":"forbidden"}'
)


async def status(client: httpx.AsyncClient, key: str, raw_chat_id: str) -> httpx.Response:
    """GET the status with ``raw_chat_id`` placed in the path exactly as given (pre-encoded)."""
    url = httpx.URL("http://ivy.test/").copy_with(
        raw_path=f"/v1/sandbox/{raw_chat_id}/status".encode()
    )
    return await client.get(url, headers={"X-Ivy-Api-Key": key})


def assert_forbidden(response: httpx.Response) -> None:
    assert response.status_code == 403
    assert response.content == FORBIDDEN_BODY
    assert response.headers["content-type"] == "application/problem+json"


async def test_owner_with_unscoped_key_sees_chats_in_and_out_of_projects(
    client: httpx.AsyncClient, world: World
) -> None:
    project = await world.project()
    key = await world.key()
    for chat in (await world.chat(project_id=project), await world.chat()):
        assert (await status(client, key, chat)).status_code == 200


async def test_missing_foreign_out_of_scope_and_malformed_chats_get_one_identical_403(
    client: httpx.AsyncClient, world: World
) -> None:
    project_a = await world.project(name="a")
    project_b = await world.project(name="b")
    scoped_key = await world.key(project_id=project_a)
    in_scope = await world.chat(project_id=project_a)
    assert (await status(client, scoped_key, in_scope)).status_code == 200
    denied = {
        "missing": "chat_doesnotexist",
        "foreign": await world.chat("user_bob"),
        "other-project": await world.chat(project_id=project_b),
        "no-project": await world.chat(),
        "malformed": "has spaces%20and%2Fslashes",
    }
    for name, chat in denied.items():
        response = await status(client, scoped_key, chat)
        assert response.status_code == 403, name
        assert_forbidden(response)


async def test_session_token_sees_every_chat_of_its_user_and_none_of_others(
    client: httpx.AsyncClient, world: World, tokens: TokenFactory
) -> None:
    own = await world.chat("user_alice", project_id=await world.project("user_alice"))
    foreign = await world.chat("user_bob")
    headers = {"Authorization": f"Bearer {tokens.token('user_alice')}"}
    assert (await client.get(f"/v1/sandbox/{own}/status", headers=headers)).status_code == 200
    assert_forbidden(await client.get(f"/v1/sandbox/{foreign}/status", headers=headers))


# Every credential form (the 200/401 side of the matrix: test_authentication.py).
FORMS: dict[str, tuple[str, Callable[[str], dict[str, str]]]] = {
    "x-ivy-api-key": ("key", lambda c: {"X-Ivy-Api-Key": c}),
    "bearer-api-key": ("key", lambda c: {"Authorization": f"Bearer {c}"}),
    "bearer-session-jwt": ("session", lambda c: {"Authorization": f"Bearer {c}"}),
    "session-cookie-jwt": ("session", lambda c: {"Cookie": f"__session={c}"}),
    "suffixed-session-cookie-jwt": ("session", lambda c: {"Cookie": f"x=1; __session_Ab={c}"}),
}


async def get_as(
    client: httpx.AsyncClient, headers: dict[str, str], raw_chat_id: str
) -> httpx.Response:
    url = httpx.URL("http://ivy.test/").copy_with(
        raw_path=f"/v1/sandbox/{raw_chat_id}/status".encode()
    )
    return await client.get(url, headers=headers)


@pytest.mark.parametrize("form", list(FORMS))
async def test_each_credential_form_gets_the_uniform_403_for_every_chat_it_may_not_read(
    client: httpx.AsyncClient, world: World, tokens: TokenFactory, form: str
) -> None:
    kind, present = FORMS[form]
    project_a = await world.project(name="a")
    project_b = await world.project(name="b")
    allowed = await world.chat(project_id=project_a)
    await world.sandbox(allowed, "active", "ready")
    denied = {
        "missing": "chat_doesnotexist",
        "foreign": await world.chat("user_bob"),
        "foreign-with-sandbox": await world.chat("user_bob"),
        "malformed": "has spaces%20and%2Fslashes",
        "empty": "",
    }
    await world.sandbox(denied["foreign-with-sandbox"], "active", "ready")
    if kind == "key":  # a key scoped to project a: other projects and loose chats are out
        credential = await world.key(project_id=project_a)
        denied["other-project"] = await world.chat(project_id=project_b)
        denied["no-project"] = await world.chat()
    else:
        credential = tokens.token("user_alice")
    headers = present(credential)
    ok = await get_as(client, headers, allowed)
    assert ok.status_code == 200, ok.text
    assert ok.json()["status"] == "active"
    for name, chat in denied.items():
        response = await get_as(client, headers, chat)
        assert response.status_code == 403, name
        assert_forbidden(response)
        assert response.headers["cache-control"] == "no-store"


async def test_another_users_key_cannot_read_a_chat_even_with_its_exact_id(
    client: httpx.AsyncClient, world: World
) -> None:
    chat = await world.chat("user_alice")
    await world.sandbox(chat, "active", "ready")
    bob_key = await world.key("user_bob")
    assert_forbidden(await status(client, bob_key, chat))


# Literal "/../" is resolved by clients (httpx, curl) before sending; its encoded forms reach us.
PATH_TRICKS = [
    "",
    "%2F",
    "%2E%2E",
    "chat_a%2F..%2Fchat_b",
    "chat_a/%2E%2E/chat_b",
    "chat_%00",
    "%FF%FE",
    quote("чат_ü", safe=""),
    quote("💥", safe=""),
    "a" * 65,
    "a" * 10_000,
    "-leading-dash",
    "chat_x%3Fy=1",
    "%3Cscript%3E",
    "x/status",
]


@pytest.mark.parametrize("raw", PATH_TRICKS)
async def test_path_tricks_in_chat_id_get_the_uniform_403_never_404_or_422(
    client: httpx.AsyncClient, world: World, raw: str
) -> None:
    key = await world.key()
    await world.chat()
    assert_forbidden(await status(client, key, raw))


async def test_unauthenticated_path_tricks_get_401_before_any_authorization(
    client: httpx.AsyncClient,
) -> None:
    for raw in PATH_TRICKS:
        url = httpx.URL("http://ivy.test/").copy_with(raw_path=f"/v1/sandbox/{raw}/status".encode())
        assert (await client.get(url)).status_code == 401, raw


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(chat_id=st.text(min_size=0, max_size=200))
async def test_any_chat_id_text_gets_only_403_never_404_422_or_5xx(
    client: httpx.AsyncClient, world: World, chat_id: str
) -> None:
    key = await world.key()
    response = await status(client, key, quote(chat_id, safe=""))
    assert_forbidden(response)


SANDBOX_OPERATIONS = [
    ("GET", "/status", None),
    ("GET", "/events", None),
    ("GET", "", None),
    ("POST", "", None),
    ("DELETE", "", None),
    ("POST", "/exec", {"command": ["true"]}),
    ("POST", "/keepalive", None),
]


@pytest.mark.parametrize(("method", "suffix", "body"), SANDBOX_OPERATIONS)
async def test_every_sandbox_operation_on_another_users_chat_gets_the_uniform_403_and_no_effect(
    client: httpx.AsyncClient, world: World, method: str, suffix: str, body: object
) -> None:
    mallory = await world.key("user_mallory")
    alice_chat = await world.chat("user_alice")
    await world.sandbox(alice_chat, "active", "ready")
    path = f"/v1/sandbox/{alice_chat}{suffix}"
    answer = await client.request(method, path, headers={"X-Ivy-Api-Key": mallory}, json=body)
    assert_forbidden(answer)
    alice = await world.key("user_alice")
    still = await client.get(f"/v1/sandbox/{alice_chat}/status", headers={"X-Ivy-Api-Key": alice})
    assert still.json()["status"] == "active"  # nothing was launched, stopped or run

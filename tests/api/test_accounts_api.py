"""User-facing REST for what users own: projects, chats and API keys (DESIGN §7).

Runs on SQLite and PostgreSQL (the ``client`` fixture is parametrized over both).
"""

from __future__ import annotations

import base64
import json
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import TokenFactory, World
from fakes import FakeClock

PROJECT_FORBIDDEN = (
    b'{"type":"urn:ivy-sandbox:error:forbidden","title":"Forbidden","status":403,'
    b'"detail":"You do not own this project, or your key\'s project scope excludes it.",'
    b'"code":"forbidden"}'
)
KEY_NOT_FOUND = (
    b'{"type":"urn:ivy-sandbox:error:not_found","title":"Not Found","status":404,'
    b'"detail":"No such API key among yours.","code":"not_found"}'
)
PROBLEM_JSON = "application/problem+json"
RFC3339_LENGTH = len("2026-11-29T10:02:02.571Z")


def session(tokens: TokenFactory, user_id: str = "user_alice") -> dict[str, str]:
    return {"Authorization": f"Bearer {tokens.token(user_id)}"}


def key_auth(key: str) -> dict[str, str]:
    return {"X-Ivy-Api-Key": key}


def assert_problem(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM_JSON
    body: dict[str, Any] = response.json()
    assert body["code"] == code
    assert body["status"] == status
    return body


def assert_timestamp(value: str) -> None:
    assert len(value) == RFC3339_LENGTH
    assert value.endswith("Z")


async def walk(
    client: httpx.AsyncClient, path: str, headers: dict[str, str], limit: int
) -> list[list[str]]:
    """Follow nextCursor to the end; the ids of each page."""
    pages: list[list[str]] = []
    params: dict[str, Any] = {"limit": limit}
    while True:
        response = await client.get(path, params=params, headers=headers)
        assert response.status_code == 200, response.text
        body = response.json()
        pages.append([item["id"] for item in body["items"]])
        if body["nextCursor"] is None:
            return pages
        params = {"limit": limit, "cursor": body["nextCursor"]}


def cursor_of(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).rstrip(b"=").decode()


# -- projects ----------------------------------------------------------------------------------
async def test_session_creates_a_project_and_lists_it(
    client: httpx.AsyncClient, tokens: TokenFactory
) -> None:
    response = await client.post("/v1/projects", json={"name": "Folding"}, headers=session(tokens))
    assert response.status_code == 201
    project = response.json()
    assert set(project) == {"id", "name", "createdAt"}
    assert project["id"].startswith("proj_")
    assert project["name"] == "Folding"
    assert_timestamp(project["createdAt"])

    listing = (await client.get("/v1/projects", headers=session(tokens))).json()
    assert listing == {"items": [project], "nextCursor": None}


async def test_unscoped_key_creates_and_lists_projects_of_its_user_only(
    client: httpx.AsyncClient, world: World
) -> None:
    key = await world.key()
    await world.project("user_bob", name="bob's")
    created = await client.post("/v1/projects", json={"name": "Mine"}, headers=key_auth(key))
    assert created.status_code == 201
    listing = (await client.get("/v1/projects", headers=key_auth(key))).json()
    assert [p["name"] for p in listing["items"]] == ["Mine"]


async def test_scoped_key_lists_only_its_project_and_cannot_create_projects(
    client: httpx.AsyncClient, world: World
) -> None:
    mine = await world.project(name="scope")
    await world.project(name="other")
    key = await world.key(project_id=mine)
    listing = (await client.get("/v1/projects", headers=key_auth(key))).json()
    assert [p["id"] for p in listing["items"]] == [mine]
    response = await client.post("/v1/projects", json={"name": "x"}, headers=key_auth(key))
    body = assert_problem(response, 403, "forbidden")
    assert "project-scoped" in body["detail"]


async def test_the_api_v1_alias_serves_the_same_endpoints(
    client: httpx.AsyncClient, tokens: TokenFactory
) -> None:
    response = await client.post(
        "/api/v1/projects", json={"name": "Alias"}, headers=session(tokens)
    )
    assert response.status_code == 201
    listing = (await client.get("/api/v1/projects", headers=session(tokens))).json()
    assert [p["name"] for p in listing["items"]] == ["Alias"]


# -- chats -------------------------------------------------------------------------------------
async def test_session_creates_lists_and_gets_chats_in_and_out_of_projects(
    client: httpx.AsyncClient, tokens: TokenFactory, world: World
) -> None:
    project = await world.project()
    headers = session(tokens)
    bare = await client.post("/v1/chats", headers=headers)  # the body may be omitted
    assert bare.status_code == 201
    assert bare.json()["projectId"] is None
    assert bare.json()["title"] is None
    titled = await client.post(
        "/v1/chats", json={"projectId": project, "title": "Fold 1UBQ"}, headers=headers
    )
    assert titled.status_code == 201
    chat = titled.json()
    assert set(chat) == {"id", "projectId", "title", "createdAt"}
    assert (chat["projectId"], chat["title"]) == (project, "Fold 1UBQ")
    assert chat["id"].startswith("chat_")
    assert_timestamp(chat["createdAt"])

    fetched = await client.get(f"/v1/chats/{chat['id']}", headers=headers)
    assert fetched.status_code == 200
    assert fetched.json() == chat
    everything = (await client.get("/v1/chats", headers=headers)).json()
    assert {c["id"] for c in everything["items"]} == {chat["id"], bare.json()["id"]}
    in_project = (
        await client.get("/v1/chats", params={"projectId": project}, headers=headers)
    ).json()
    assert in_project == {"items": [chat], "nextCursor": None}


async def test_unscoped_key_creates_lists_and_gets_chats(
    client: httpx.AsyncClient, world: World
) -> None:
    key = await world.key()
    project = await world.project()
    await world.chat("user_bob")
    created = await client.post("/v1/chats", json={"projectId": project}, headers=key_auth(key))
    assert created.status_code == 201
    chat_id = created.json()["id"]
    assert (await client.get(f"/v1/chats/{chat_id}", headers=key_auth(key))).status_code == 200
    listing = (await client.get("/v1/chats", headers=key_auth(key))).json()
    assert [c["id"] for c in listing["items"]] == [chat_id]


async def test_a_new_chat_is_immediately_usable_on_the_sandbox_endpoints(
    client: httpx.AsyncClient, world: World
) -> None:
    key = await world.key()
    chat_id = (await client.post("/v1/chats", headers=key_auth(key))).json()["id"]
    status = await client.get(f"/v1/sandbox/{chat_id}/status", headers=key_auth(key))
    assert status.status_code == 200
    assert status.json() == {"status": "none"}


async def test_scoped_key_chats_default_to_its_project_and_other_projects_are_refused(
    client: httpx.AsyncClient, world: World
) -> None:
    scope = await world.project(name="scope")
    other = await world.project(name="other")
    in_scope = await world.chat(project_id=scope)
    outside = await world.chat(project_id=other)
    unfiled = await world.chat()
    key = await world.key(project_id=scope)

    created = await client.post("/v1/chats", json={"title": "t"}, headers=key_auth(key))
    assert created.status_code == 201
    assert created.json()["projectId"] == scope
    explicit = await client.post("/v1/chats", json={"projectId": scope}, headers=key_auth(key))
    assert explicit.status_code == 201

    refused = await client.post("/v1/chats", json={"projectId": other}, headers=key_auth(key))
    assert refused.status_code == 403
    assert refused.content == PROJECT_FORBIDDEN

    listing = (await client.get("/v1/chats", headers=key_auth(key))).json()
    seen = {c["id"] for c in listing["items"]}
    assert seen == {in_scope, created.json()["id"], explicit.json()["id"]}
    assert outside not in seen
    assert unfiled not in seen
    filtered = await client.get("/v1/chats", params={"projectId": other}, headers=key_auth(key))
    assert filtered.content == PROJECT_FORBIDDEN


async def test_a_project_id_you_may_not_use_gets_one_identical_403_everywhere(
    client: httpx.AsyncClient, world: World, tokens: TokenFactory
) -> None:
    scope = await world.project(name="scope")
    other = await world.project(name="other")
    scoped_key = await world.key(project_id=scope)
    bobs = await world.project("user_bob", name="bob's")
    cases: dict[str, tuple[dict[str, str], str]] = {
        "missing": (session(tokens), "proj_doesnotexist"),
        "foreign": (session(tokens), bobs),
        "malformed": (session(tokens), "has spaces/and slashes"),
        "too-long": (session(tokens), "p" * 65),
        "out-of-scope": (key_auth(scoped_key), other),
        "foreign-with-key": (key_auth(scoped_key), bobs),
    }
    for name, (headers, project_id) in cases.items():
        responses = [
            await client.post("/v1/chats", json={"projectId": project_id}, headers=headers),
            await client.get("/v1/chats", params={"projectId": project_id}, headers=headers),
        ]
        if "Authorization" in headers:  # key creation needs a session
            responses.append(
                await client.post("/v1/api-keys", json={"projectId": project_id}, headers=headers)
            )
        for response in responses:
            assert response.status_code == 403, name
            assert response.content == PROJECT_FORBIDDEN, name
            assert response.headers["content-type"] == PROBLEM_JSON


async def test_get_chat_denies_missing_foreign_out_of_scope_and_malformed_with_the_sandbox_403(
    client: httpx.AsyncClient, world: World
) -> None:
    scope = await world.project(name="scope")
    other = await world.project(name="other")
    key = await world.key(project_id=scope)
    assert (
        await client.get(f"/v1/chats/{await world.chat(project_id=scope)}", headers=key_auth(key))
    ).status_code == 200
    sandbox_403 = await client.get("/v1/sandbox/chat_doesnotexist/status", headers=key_auth(key))
    missing = await client.get("/v1/chats/chat_doesnotexist", headers=key_auth(key))
    assert missing.status_code == 403
    assert missing.content == sandbox_403.content
    assert missing.headers["content-type"] == PROBLEM_JSON
    denied = {
        "foreign": await world.chat("user_bob"),
        "other-project": await world.chat(project_id=other),
        "no-project": await world.chat(),
        "malformed": "has%20spaces%2Fand%2Fslashes",
        "empty": "",
        "dots": "%2E%2E",
        "nested": "a/b/c",
        "long": "c" * 500,
    }
    for name, raw in denied.items():
        url = httpx.URL("http://ivy.test/").copy_with(raw_path=f"/v1/chats/{raw}".encode())
        response = await client.get(url, headers=key_auth(key))
        assert response.status_code == 403, name
        assert response.content == missing.content, name


# -- pagination --------------------------------------------------------------------------------
async def create_items(
    client: httpx.AsyncClient,
    kind: str,
    headers: dict[str, str],
    count: int,
    clock: FakeClock,
    *,
    advance: float,
) -> list[str]:
    bodies = {"projects": {"name": "p"}, "chats": {"title": "c"}, "api-keys": {"name": "k"}}
    ids = []
    for _ in range(count):
        response = await client.post(f"/v1/{kind}", json=bodies[kind], headers=headers)
        assert response.status_code == 201, response.text
        ids.append(response.json()["id"])
        clock.advance(advance)
    return ids


@pytest.mark.parametrize("kind", ["projects", "chats", "api-keys"])
@pytest.mark.parametrize("advance", [0.0, 0.25], ids=["same-instant", "spread"])
async def test_pagination_walks_every_page_without_duplicates_or_gaps(
    client: httpx.AsyncClient, tokens: TokenFactory, clock: FakeClock, kind: str, advance: float
) -> None:
    headers = session(tokens)
    created = await create_items(client, kind, headers, 7, clock, advance=advance)
    pages = await walk(client, f"/v1/{kind}", headers, limit=3)
    assert [len(page) for page in pages] == [3, 3, 1]
    seen = [item for page in pages for item in page]
    assert len(seen) == len(set(seen))
    assert set(seen) == set(created)
    whole = (await client.get(f"/v1/{kind}", params={"limit": 100}, headers=headers)).json()
    assert [item["id"] for item in whole["items"]] == seen  # one order, however you page
    assert whole["nextCursor"] is None
    if advance:
        assert seen == created  # oldest first


async def test_an_exact_multiple_of_the_limit_ends_with_a_null_cursor_not_an_empty_page(
    client: httpx.AsyncClient, tokens: TokenFactory, clock: FakeClock
) -> None:
    headers = session(tokens)
    await create_items(client, "projects", headers, 6, clock, advance=1)
    pages = await walk(client, "/v1/projects", headers, limit=3)
    assert [len(page) for page in pages] == [3, 3]


async def test_empty_lists_have_no_items_and_a_null_cursor(
    client: httpx.AsyncClient, tokens: TokenFactory
) -> None:
    for kind in ("projects", "chats", "api-keys"):
        response = await client.get(f"/v1/{kind}", headers=session(tokens))
        assert response.json() == {"items": [], "nextCursor": None}


@pytest.mark.parametrize("advance", [0.0, 1.0], ids=["same-instant", "spread"])
async def test_pagination_survives_inserts_during_the_walk(
    client: httpx.AsyncClient, tokens: TokenFactory, clock: FakeClock, advance: float
) -> None:
    headers = session(tokens)
    original = await create_items(client, "chats", headers, 7, clock, advance=advance)
    seen: list[str] = []
    params: dict[str, Any] = {"limit": 3}
    inserted: list[str] = []
    while True:
        body = (await client.get("/v1/chats", params=params, headers=headers)).json()
        seen.extend(item["id"] for item in body["items"])
        # Someone creates chats between our page requests.
        inserted += await create_items(client, "chats", headers, 2, clock, advance=advance)
        if body["nextCursor"] is None:
            break
        params = {"limit": 3, "cursor": body["nextCursor"]}
    assert len(seen) == len(set(seen))  # no duplicates
    assert set(original) <= set(seen)  # no gaps
    assert set(seen) <= set(original) | set(inserted)
    if advance:
        assert seen[: len(original)] == original  # newer items only ever come after


@pytest.mark.parametrize(
    "cursor",
    [
        "not a cursor",
        "!!!!",
        "a",
        "=" * 8,
        "x" * 600,
        cursor_of("no-separator"),
        cursor_of("not-a-time|chat_abc"),
        cursor_of("2026-11-29T10:02:02|chat_abc"),  # no time zone
        cursor_of("2026-11-29T10:02:02+00:00|bad id!"),
        cursor_of("2026-11-29T10:02:02+00:00|"),
        cursor_of("0001-01-01T00:00:00+01:00|chat_abc"),  # before year 1 in UTC
        base64.urlsafe_b64encode(b"\xff\xfe|\x00").decode(),
    ],
)
async def test_malformed_cursor_is_422_with_a_problem_body(
    client: httpx.AsyncClient, tokens: TokenFactory, cursor: str
) -> None:
    for kind in ("projects", "chats", "api-keys"):
        response = await client.get(
            f"/v1/{kind}", params={"cursor": cursor}, headers=session(tokens)
        )
        assert_problem(response, 422, "invalid_request")


async def test_a_valid_looking_cursor_from_elsewhere_just_positions_the_page(
    client: httpx.AsyncClient, tokens: TokenFactory, clock: FakeClock
) -> None:
    headers = session(tokens)
    await create_items(client, "projects", headers, 2, clock, advance=1)
    far_future = cursor_of("9999-01-01T00:00:00+00:00|zzz")
    response = await client.get("/v1/projects", params={"cursor": far_future}, headers=headers)
    assert response.json() == {"items": [], "nextCursor": None}


@pytest.mark.parametrize("limit", ["0", "-1", "101", "1000000000000000000000", "x", "1.5", ""])
async def test_limit_outside_1_to_100_is_422(
    client: httpx.AsyncClient, tokens: TokenFactory, limit: str
) -> None:
    for kind in ("projects", "chats", "api-keys"):
        response = await client.get(f"/v1/{kind}", params={"limit": limit}, headers=session(tokens))
        assert_problem(response, 422, "invalid_request")


async def test_limits_1_and_100_are_accepted(
    client: httpx.AsyncClient, tokens: TokenFactory, clock: FakeClock
) -> None:
    headers = session(tokens)
    await create_items(client, "projects", headers, 2, clock, advance=1)
    one = (await client.get("/v1/projects", params={"limit": 1}, headers=headers)).json()
    assert len(one["items"]) == 1
    assert one["nextCursor"] is not None
    hundred = (await client.get("/v1/projects", params={"limit": 100}, headers=headers)).json()
    assert len(hundred["items"]) == 2
    assert hundred["nextCursor"] is None


async def test_default_page_size_is_50(
    client: httpx.AsyncClient, world: World, tokens: TokenFactory
) -> None:
    for _ in range(51):
        await world.chat()
    first = (await client.get("/v1/chats", headers=session(tokens))).json()
    assert len(first["items"]) == 50
    assert first["nextCursor"] is not None


# -- API keys ----------------------------------------------------------------------------------
async def test_session_creates_a_key_that_works_at_once_and_is_shown_only_once(
    client: httpx.AsyncClient, tokens: TokenFactory, world: World
) -> None:
    chat = await world.chat()
    response = await client.post(
        "/v1/api-keys", json={"name": "CI", "expiresInSeconds": 3600}, headers=session(tokens)
    )
    assert response.status_code == 201
    created = response.json()
    key = created["key"]
    assert key.startswith(f"ivy_{created['id']}_")
    assert created["state"] == "active"
    assert created["name"] == "CI"
    assert created["projectId"] is None
    assert created["revokedAt"] is None
    assert created["lastUsedAt"] is None
    assert_timestamp(created["expiresAt"])

    status = await client.get(f"/v1/sandbox/{chat}/status", headers=key_auth(key))
    assert status.status_code == 200

    listing = await client.get("/v1/api-keys", headers=session(tokens))
    assert listing.status_code == 200
    (record,) = listing.json()["items"]
    assert set(record) == {
        "id",
        "name",
        "projectId",
        "state",
        "createdAt",
        "expiresAt",
        "revokedAt",
        "lastUsedAt",
    }
    assert record["id"] == created["id"]
    assert record["lastUsedAt"] is not None
    secret_part = key.rsplit("_", 1)[1]
    assert secret_part not in listing.text
    assert "key" not in record


async def test_listing_shows_revoked_and_expired_keys_with_their_state_but_no_secret(
    client: httpx.AsyncClient, tokens: TokenFactory, clock: FakeClock
) -> None:
    headers = session(tokens)
    short = (
        await client.post("/v1/api-keys", json={"expiresInSeconds": 10}, headers=headers)
    ).json()
    revoked = (await client.post("/v1/api-keys", headers=headers)).json()
    active = (await client.post("/v1/api-keys", json={"name": "live"}, headers=headers)).json()
    assert (
        await client.delete(f"/v1/api-keys/{revoked['id']}", headers=headers)
    ).status_code == 204
    clock.advance(11)
    listing = await client.get("/v1/api-keys", headers=session(tokens))
    states = {item["id"]: item["state"] for item in listing.json()["items"]}
    assert states == {short["id"]: "expired", revoked["id"]: "revoked", active["id"]: "active"}
    for created in (short, revoked, active):
        assert created["key"] not in listing.text


async def test_a_key_revoked_through_the_api_is_refused_by_this_server_at_once(
    client: httpx.AsyncClient, tokens: TokenFactory, world: World
) -> None:
    chat = await world.chat()
    created = (await client.post("/v1/api-keys", headers=session(tokens))).json()
    url = f"/v1/sandbox/{chat}/status"
    assert (await client.get(url, headers=key_auth(created["key"]))).status_code == 200

    response = await client.delete(f"/v1/api-keys/{created['id']}", headers=session(tokens))
    assert response.status_code == 204
    assert response.content == b""
    # No clock advance: the revoking process drops its own cache (others take up to 5 s).
    rejected = await client.get(url, headers=key_auth(created["key"]))
    assert_problem(rejected, 401, "unauthenticated")

    again = await client.delete(f"/v1/api-keys/{created['id']}", headers=session(tokens))
    assert again.status_code == 204  # idempotent
    (record,) = (await client.get("/v1/api-keys", headers=session(tokens))).json()["items"]
    assert record["state"] == "revoked"


async def test_a_scoped_key_created_by_a_session_sees_only_its_project(
    client: httpx.AsyncClient, tokens: TokenFactory, world: World
) -> None:
    scope = await world.project(name="scope")
    inside = await world.chat(project_id=scope)
    outside = await world.chat()
    created = await client.post("/v1/api-keys", json={"projectId": scope}, headers=session(tokens))
    assert created.status_code == 201
    assert created.json()["projectId"] == scope
    key = key_auth(created.json()["key"])
    assert (await client.get(f"/v1/sandbox/{inside}/status", headers=key)).status_code == 200
    assert (await client.get(f"/v1/sandbox/{outside}/status", headers=key)).status_code == 403
    listing = (await client.get("/v1/chats", headers=key)).json()
    assert [c["id"] for c in listing["items"]] == [inside]


@pytest.mark.parametrize("scoped", [False, True], ids=["unscoped-key", "scoped-key"])
async def test_an_api_key_cannot_create_list_or_revoke_keys(
    client: httpx.AsyncClient, world: World, scoped: bool
) -> None:
    project = await world.project() if scoped else None
    key = await world.key(project_id=project)
    kid = key.split("_")[1]
    attempts = [
        await client.post("/v1/api-keys", json={"name": "minted"}, headers=key_auth(key)),
        await client.post("/v1/api-keys", headers=key_auth(key)),
        await client.get("/v1/api-keys", headers=key_auth(key)),
        await client.delete(f"/v1/api-keys/{kid}", headers=key_auth(key)),
        await client.delete("/v1/api-keys/doesnotexist", headers=key_auth(key)),
    ]
    for response in attempts:
        body = assert_problem(response, 403, "session_required")
        assert "session" in body["detail"]
    assert attempts[0].content == attempts[2].content == attempts[3].content
    still = await client.get("/v1/projects", headers=key_auth(key))
    assert still.status_code == 200  # the key itself was not revoked


async def test_revoking_another_users_key_is_refused_exactly_like_a_missing_key(
    client: httpx.AsyncClient, tokens: TokenFactory, world: World, clock: FakeClock
) -> None:
    bob_key = await world.key("user_bob")
    bob_kid = bob_key.split("_")[1]
    foreign = await client.delete(f"/v1/api-keys/{bob_kid}", headers=session(tokens))
    missing = await client.delete("/v1/api-keys/AAAAAAAAAAAA", headers=session(tokens))
    malformed = await client.delete("/v1/api-keys/not%20an%20id", headers=session(tokens))
    empty = await client.delete("/v1/api-keys/", headers=session(tokens))
    for response in (foreign, missing, malformed, empty):
        assert response.status_code == 404
        assert response.content == KEY_NOT_FOUND
        assert response.headers["content-type"] == PROBLEM_JSON
    clock.advance(6)
    assert (await client.get("/v1/projects", headers=key_auth(bob_key))).status_code == 200
    bobs = (await client.get("/v1/api-keys", headers=session(tokens, "user_bob"))).json()
    assert [k["state"] for k in bobs["items"]] == ["active"]


async def test_key_listings_are_per_user(
    client: httpx.AsyncClient, tokens: TokenFactory, world: World
) -> None:
    await world.key("user_bob")
    mine = (await client.post("/v1/api-keys", headers=session(tokens))).json()
    listing = (await client.get("/v1/api-keys", headers=session(tokens))).json()
    assert [k["id"] for k in listing["items"]] == [mine["id"]]


# -- validation and authentication -------------------------------------------------------------
INVALID_BODIES: list[tuple[str, Any]] = [
    ("/v1/projects", {}),
    ("/v1/projects", {"name": ""}),
    ("/v1/projects", {"name": "   "}),
    ("/v1/projects", {"name": "a" * 201}),
    ("/v1/projects", {"name": "tab\there"}),
    ("/v1/projects", {"name": "new\nline"}),
    ("/v1/projects", {"name": "nul\x00"}),
    ("/v1/projects", {"name": 42}),
    ("/v1/projects", {"name": None}),
    ("/v1/projects", {"name": "ok", "extra": 1}),
    ("/v1/projects", ["name"]),
    ("/v1/chats", {"title": ""}),
    ("/v1/chats", {"title": "t" * 501}),
    ("/v1/chats", {"title": "\x1b[31mred"}),
    ("/v1/chats", {"projectId": 7}),
    ("/v1/chats", {"projectID": "proj_x"}),
    ("/v1/chats", "just a string"),
    ("/v1/api-keys", {"name": ""}),
    ("/v1/api-keys", {"name": "n" * 201}),
    ("/v1/api-keys", {"name": "line\nbreak"}),
    ("/v1/api-keys", {"expiresInSeconds": 0}),
    ("/v1/api-keys", {"expiresInSeconds": -5}),
    ("/v1/api-keys", {"expiresInSeconds": 10**30}),
    ("/v1/api-keys", {"expiresInSeconds": "soon"}),
    ("/v1/api-keys", {"key": "ivy_choose_my_own"}),
]


@pytest.mark.parametrize(("path", "body"), INVALID_BODIES)
async def test_invalid_bodies_are_422_problems(
    client: httpx.AsyncClient, tokens: TokenFactory, path: str, body: Any
) -> None:
    response = await client.post(path, json=body, headers=session(tokens))
    assert_problem(response, 422, "invalid_request")


@pytest.mark.parametrize("path", ["/v1/projects", "/v1/chats", "/v1/api-keys"])
async def test_a_body_that_is_not_json_is_422(
    client: httpx.AsyncClient, tokens: TokenFactory, path: str
) -> None:
    headers = session(tokens) | {"Content-Type": "application/json"}
    response = await client.post(path, content=b"{not json", headers=headers)
    assert_problem(response, 422, "invalid_request")


async def test_names_and_titles_at_their_limits_are_accepted(
    client: httpx.AsyncClient, tokens: TokenFactory
) -> None:
    headers = session(tokens)
    project = await client.post("/v1/projects", json={"name": "é" * 200}, headers=headers)
    assert project.status_code == 201
    chat = await client.post("/v1/chats", json={"title": "💥" * 500}, headers=headers)
    assert chat.status_code == 201
    assert chat.json()["title"] == "💥" * 500


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/projects"),
        ("GET", "/v1/projects"),
        ("POST", "/v1/chats"),
        ("GET", "/v1/chats"),
        ("GET", "/v1/chats/chat_abc"),
        ("POST", "/v1/api-keys"),
        ("GET", "/v1/api-keys"),
        ("DELETE", "/v1/api-keys/abc"),
    ],
)
async def test_every_endpoint_needs_credentials(
    client: httpx.AsyncClient, method: str, path: str
) -> None:
    response = await client.request(method, path, json={"name": "x"})
    assert_problem(response, 401, "unauthenticated")
    assert response.headers["www-authenticate"] == 'Bearer realm="ivy"'
    assert response.headers["cache-control"] == "no-store"


# -- OpenAPI -----------------------------------------------------------------------------------
NEW_OPERATIONS = {
    ("/v1/projects", "post"): ("createProject", {"201", "401", "403", "413", "422", "429"}),
    ("/v1/projects", "get"): ("listProjects", {"200", "401", "422", "429"}),
    ("/v1/chats", "post"): ("createChat", {"201", "401", "403", "413", "422", "429"}),
    ("/v1/chats", "get"): ("listChats", {"200", "401", "403", "422", "429"}),
    ("/v1/chats/{chatId}", "get"): ("getChat", {"200", "401", "403", "429"}),
    ("/v1/api-keys", "post"): ("createApiKey", {"201", "401", "403", "413", "422", "429"}),
    ("/v1/api-keys", "get"): ("listApiKeys", {"200", "401", "403", "422", "429"}),
    ("/v1/api-keys/{keyId}", "delete"): ("revokeApiKey", {"204", "401", "403", "404", "429"}),
}


def resolve(document: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in schema:
        resolved: dict[str, Any] = document["components"]["schemas"][
            schema["$ref"].rsplit("/", 1)[1]
        ]
        return resolved
    return schema


async def test_openapi_documents_every_new_operation_with_errors_and_examples(
    client: httpx.AsyncClient,
) -> None:
    document = (await client.get("/openapi.json")).json()
    assert not any(path.startswith("/api/") for path in document["paths"])
    for (path, method), (operation_id, codes) in NEW_OPERATIONS.items():
        operation = document["paths"][path][method]
        assert operation["operationId"] == operation_id
        assert operation["summary"]
        assert len(operation["description"]) > 40
        assert set(operation["responses"]) == codes, path
        for code, response in operation["responses"].items():
            assert response["description"], (path, code)
            if code.startswith(("4", "5")):
                problem = response["content"]["application/problem+json"]["schema"]
                assert problem == {"$ref": "#/components/schemas/Problem"}
        success = next(r for c, r in operation["responses"].items() if c.startswith("2"))
        if "content" in success:
            schema = resolve(document, success["content"]["application/json"]["schema"])
            assert schema.get("examples"), (path, method)
        if "requestBody" in operation:
            body_schema = operation["requestBody"]["content"]["application/json"]["schema"]
            body_schema = resolve(document, body_schema.get("anyOf", [body_schema])[0])
            assert body_schema.get("examples"), (path, method)
            assert all("examples" in p for p in body_schema["properties"].values())
        for parameter in operation.get("parameters", []):
            assert parameter.get("description"), (path, parameter["name"])


async def test_openapi_describes_pagination_and_the_session_only_key_rules(
    client: httpx.AsyncClient,
) -> None:
    document = (await client.get("/openapi.json")).json()
    paths = document["paths"]
    for path in ("/v1/projects", "/v1/chats", "/v1/api-keys"):
        operation = paths[path]["get"]
        names = {p["name"]: p for p in operation["parameters"]}
        assert {"limit", "cursor"} <= set(names)
        assert (names["limit"]["schema"]["minimum"], names["limit"]["schema"]["maximum"]) == (
            1,
            100,
        )
        assert "nextCursor" in operation["description"]
    for path, method in (
        ("/v1/api-keys", "post"),
        ("/v1/api-keys", "get"),
        ("/v1/api-keys/{keyId}", "delete"),
    ):
        assert "session_required" in paths[path][method]["description"]
    created = document["components"]["schemas"]["ApiKeyCreated"]
    assert "key" in created["properties"]
    assert "key" not in document["components"]["schemas"]["ApiKey"]["properties"]
    # The chat endpoint promises the sandbox endpoints' 403, and its response is the chat.
    chat_403 = paths["/v1/chats/{chatId}"]["get"]["responses"]["403"]["description"]
    status_403 = paths["/v1/sandbox/{chatId}/status"]["get"]["responses"]["403"]["description"]
    assert chat_403 == status_403
    json.dumps(document)  # serializable as is


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(text=st.text(max_size=120))
async def test_any_cursor_or_chat_id_text_is_answered_never_with_a_5xx(
    client: httpx.AsyncClient, world: World, text: str
) -> None:
    key = await world.key()
    listing = await client.get("/v1/chats", params={"cursor": text}, headers=key_auth(key))
    assert listing.status_code in (200, 422)
    raw = quote(text, safe="")
    url = httpx.URL("http://ivy.test/").copy_with(raw_path=f"/v1/chats/{raw}".encode())
    chat = await client.get(url, headers=key_auth(key))
    assert chat.status_code == 403

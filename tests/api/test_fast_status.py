"""The plain status poll is answered by a fast ASGI path; it must answer exactly like the
documented FastAPI route (which still serves long-polls and ids containing '/')."""

from __future__ import annotations

import httpx
import pytest

from conftest import World, metric
from ivy_sandbox.bootstrap import Services


async def both(
    client: httpx.AsyncClient, path: str, headers: dict[str, str]
) -> tuple[httpx.Response, httpx.Response]:
    fast = await client.get(path, headers=headers)
    # `Prefer: wait=0` sends the same request through FastAPI's route without waiting.
    routed = await client.get(path, headers=headers | {"Prefer": "wait=0"})
    return fast, routed


def same_answer(fast: httpx.Response, routed: httpx.Response) -> None:
    assert fast.status_code == routed.status_code
    assert fast.content == routed.content
    for header in (
        "content-type",
        "cache-control",
        "x-content-type-options",
        "www-authenticate",
        "retry-after",
        "ratelimit-policy",
    ):
        assert fast.headers.get(header) == routed.headers.get(header), header
    assert "preference-applied" not in fast.headers
    assert "preference-applied" in routed.headers or routed.status_code != 200


@pytest.mark.parametrize(
    ("status", "phase", "extra"),
    [
        (None, None, {}),
        ("provisioning", "compute", {"eta_seconds": 30.0}),
        ("provisioning", "mount", {}),
        ("active", "ready", {}),
        (
            "failed",
            "failed",
            {"error_message": "mount: no workspace", "error_code": "mount_failed"},
        ),
    ],
)
async def test_the_fast_path_answers_every_state_exactly_like_the_route(
    client: httpx.AsyncClient,
    world: World,
    status: str | None,
    phase: str | None,
    extra: dict[str, object],
) -> None:
    key, chat = await world.key(), await world.chat()
    if status is not None:
        await world.sandbox(chat, status, phase, **extra)
    for prefix in ("/v1", "/api/v1"):
        fast, routed = await both(client, f"{prefix}/sandbox/{chat}/status", {"X-Ivy-Api-Key": key})
        assert fast.status_code == 200
        same_answer(fast, routed)


async def test_the_fast_path_refuses_exactly_like_the_route(
    client: httpx.AsyncClient, world: World
) -> None:
    key = await world.key()
    foreign = await world.chat("user_bob")
    cases = [
        ("/v1/sandbox/chat_missing/status", {"X-Ivy-Api-Key": key}),
        (f"/v1/sandbox/{foreign}/status", {"Authorization": f"Bearer {key}"}),
        ("/v1/sandbox/chat_x/status", {}),
        ("/v1/sandbox/chat_x/status", {"Authorization": "Basic abc"}),
        ("/v1/sandbox/chat_x/status", {"X-Ivy-Api-Key": key[:-1] + "x"}),
        ("/v1/sandbox//status", {"X-Ivy-Api-Key": key}),
    ]
    for path, headers in cases:
        fast, routed = await both(client, path, headers)
        assert fast.status_code in (401, 403), path
        same_answer(fast, routed)


async def test_ids_with_slashes_and_long_polls_still_reach_the_route(
    client: httpx.AsyncClient, world: World
) -> None:
    key = await world.key()
    slashed = await client.get("/v1/sandbox/a%2Fb/status", headers={"X-Ivy-Api-Key": key})
    assert slashed.status_code == 403
    chat = await world.chat()
    long_poll = await client.get(
        f"/v1/sandbox/{chat}/status", headers={"X-Ivy-Api-Key": key, "Prefer": "wait=0"}
    )
    assert long_poll.headers["preference-applied"] == "wait=0"
    assert long_poll.headers["etag"]


async def test_the_fast_path_keeps_a_sane_request_id_and_makes_one_otherwise(
    client: httpx.AsyncClient, world: World
) -> None:
    key, chat = await world.key(), await world.chat()
    path, auth = f"/v1/sandbox/{chat}/status", {"X-Ivy-Api-Key": key}
    kept = await client.get(path, headers=auth | {"X-Request-Id": "trace-1.a"})
    assert kept.headers["x-request-id"] == "trace-1.a"
    made = await client.get(path, headers=auth | {"X-Request-Id": "bad id!"})
    assert made.headers["x-request-id"] not in ("bad id!", "")
    refused = await client.get(path)
    assert refused.status_code == 401
    assert refused.headers["x-request-id"]
    assert "preference-applied" not in made.headers  # it was the fast path that answered


async def test_the_fast_path_counts_requests_by_route_template_and_code(
    client: httpx.AsyncClient, world: World
) -> None:
    key, chat = await world.key(), await world.chat()
    labels = {"route": "/v1/sandbox/{chatId}/status", "method": "GET"}
    before = (await client.get("/metrics")).text
    await client.get(f"/v1/sandbox/{chat}/status", headers={"X-Ivy-Api-Key": key})
    await client.get(f"/v1/sandbox/{chat}/status")
    after = (await client.get("/metrics")).text
    for code in ("200", "401"):
        counted = metric(after, "ivy_http_requests_total", code=code, **labels)
        assert counted - metric(before, "ivy_http_requests_total", code=code, **labels) == 1
    assert chat not in after  # chat ids never become label values


async def test_oversized_headers_and_bodies_on_a_poll_get_the_middlewares_answers(
    client: httpx.AsyncClient, world: World
) -> None:
    key, chat = await world.key(), await world.chat()
    path, auth = f"/v1/sandbox/{chat}/status", {"X-Ivy-Api-Key": key}
    huge = await client.get(path, headers=auth | {"X-Filler": "x" * 20_000})
    assert huge.status_code == 431
    assert huge.json()["code"] == "headers_too_large"
    with_body = await client.request("GET", path, headers=auth, content=b"x" * 3_000_000)
    assert with_body.status_code == 413


async def test_a_bug_behind_the_fast_path_is_a_plain_500_problem(
    client: httpx.AsyncClient, world: World, services: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    key, chat = await world.key(), await world.chat()

    async def broken(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(services.repository, "chat_access", broken)
    answer = await client.get(f"/v1/sandbox/{chat}/status", headers={"X-Ivy-Api-Key": key})
    assert answer.status_code == 500
    assert answer.json()["code"] == "internal_error"
    assert "a bug" not in answer.text
    assert answer.headers["cache-control"] == "no-store"

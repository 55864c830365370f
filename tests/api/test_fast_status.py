"""The plain status poll is answered by a fast ASGI path; it must answer exactly like the
documented FastAPI route (which still serves long-polls and ids containing '/')."""

from __future__ import annotations

import httpx
import pytest

from conftest import World


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

"""405 answers: the documented problem body, and an ``Allow`` header that tells the truth —
every method it lists is served at that path (a client may retry with any of them)."""

from __future__ import annotations

import httpx
import pytest

from conftest import World

PATHS = (
    "/v1/sandbox/{chat}/status",
    "/v1/sandbox/{chat}",
    "/v1/sandbox/{chat}/events",
    "/v1/sandbox/{chat}/exec",
    "/v1/chats",
    "/v1/projects",
    "/v1/api-keys",
    "/api/v1/sandbox/{chat}/status",
)


@pytest.mark.parametrize("template", PATHS)
async def test_every_method_a_405_allows_is_really_served(
    client: httpx.AsyncClient, world: World, template: str
) -> None:
    key, chat = await world.key(), await world.chat()
    path = template.format(chat=chat)
    refused = await client.request("PATCH", path, headers={"X-Ivy-Api-Key": key})
    assert refused.status_code == 405
    assert refused.json()["code"] == "method_not_allowed"
    allowed = [m.strip() for m in refused.headers["allow"].split(",")]
    assert allowed
    assert "PATCH" not in allowed
    for method in allowed:
        if method == "GET" and path.endswith("/events"):
            continue  # a stream: its answer is checked in test_watch
        answer = await client.request(method, path, headers={"X-Ivy-Api-Key": key}, json={})
        assert answer.status_code != 405, (method, path, answer.text)

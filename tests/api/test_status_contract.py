"""The status endpoint's exact shape, headers and OpenAPI description (the seed page)."""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone

import httpx
import pytest

from conftest import World
from fakes import FakeClock

RFC3339_Z = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$")


@pytest.fixture
async def key_and_chat(world: World) -> tuple[str, str]:
    return await world.key(), await world.chat()


async def get_status(client: httpx.AsyncClient, key: str, chat_id: str) -> httpx.Response:
    return await client.get(f"/v1/sandbox/{chat_id}/status", headers={"X-Ivy-Api-Key": key})


async def test_chat_without_sandbox_reports_only_status_none(
    client: httpx.AsyncClient, key_and_chat: tuple[str, str]
) -> None:
    key, chat = key_and_chat
    response = await get_status(client, key, chat)
    assert response.status_code == 200
    assert response.content == b'{"status":"none"}'
    assert response.headers["content-type"] == "application/json"


async def test_provisioning_sandbox_reports_phase_integer_eta_and_created_at(
    client: httpx.AsyncClient, world: World, key_and_chat: tuple[str, str]
) -> None:
    key, chat = key_and_chat
    await world.sandbox(chat, "provisioning", "compute", eta_seconds=12)
    body = (await get_status(client, key, chat)).json()
    assert list(body) == ["status", "phase", "etaSeconds", "createdAt"]
    assert body["status"] == "provisioning"
    assert body["phase"] == "compute"
    assert body["etaSeconds"] == 12
    assert isinstance(body["etaSeconds"], int)
    assert RFC3339_Z.match(body["createdAt"])


async def test_eta_counts_down_with_elapsed_time_and_never_goes_negative(
    client: httpx.AsyncClient, world: World, clock: FakeClock, key_and_chat: tuple[str, str]
) -> None:
    key, chat = key_and_chat
    await world.sandbox(chat, "provisioning", "mount", eta_seconds=5)
    clock.advance(2.2)
    assert (await get_status(client, key, chat)).json()["etaSeconds"] == 3
    clock.advance(30)
    assert (await get_status(client, key, chat)).json()["etaSeconds"] == 0


async def test_provisioning_without_an_estimate_omits_eta_instead_of_null(
    client: httpx.AsyncClient, world: World, key_and_chat: tuple[str, str]
) -> None:
    key, chat = key_and_chat
    await world.sandbox(chat, "provisioning", "mount")
    body = (await get_status(client, key, chat)).json()
    assert body.keys() == {"status", "phase", "createdAt"}
    assert body["phase"] == "mount"


async def test_active_sandbox_reports_ready_phase_and_no_eta_or_error(
    client: httpx.AsyncClient, world: World, key_and_chat: tuple[str, str]
) -> None:
    key, chat = key_and_chat
    await world.sandbox(chat, "active", "ready", eta_seconds=3, error_message="stale")
    body = (await get_status(client, key, chat)).json()
    assert body.keys() == {"status", "phase", "createdAt"}
    assert (body["status"], body["phase"]) == ("active", "ready")


async def test_failed_sandbox_reports_error_message_and_failed_phase(
    client: httpx.AsyncClient, world: World, key_and_chat: tuple[str, str]
) -> None:
    key, chat = key_and_chat
    await world.sandbox(
        chat, "failed", "failed", error_code="mount_failed", error_message="Workspace missing"
    )
    body = (await get_status(client, key, chat)).json()
    assert body == {
        "status": "failed",
        "phase": "failed",
        "errorMessage": "Workspace missing",
        "createdAt": body["createdAt"],
    }
    assert list(body) == ["status", "phase", "errorMessage", "createdAt"]


async def test_created_at_is_the_sandbox_creation_time_in_utc_with_milliseconds(
    client: httpx.AsyncClient, world: World, key_and_chat: tuple[str, str]
) -> None:
    key, chat = key_and_chat
    plus_two = timezone(timedelta(hours=2))
    created = datetime(2026, 11, 29, 11, 30, 15, 123456, tzinfo=plus_two)
    await world.sandbox(chat, "active", "ready", created_at=created)
    body = (await get_status(client, key, chat)).json()
    assert body["createdAt"] == "2026-11-29T09:30:15.123Z"


async def test_every_response_forbids_caching_and_sniffing(
    client: httpx.AsyncClient, key_and_chat: tuple[str, str]
) -> None:
    key, chat = key_and_chat
    for response in (
        await get_status(client, key, chat),
        await client.get(f"/v1/sandbox/{chat}/status"),
        await get_status(client, key, "chat_nope"),
    ):
        assert response.headers["cache-control"] == "no-store"
        assert response.headers["x-content-type-options"] == "nosniff"


async def test_api_v1_alias_answers_exactly_like_v1(
    client: httpx.AsyncClient, world: World, key_and_chat: tuple[str, str]
) -> None:
    key, chat = key_and_chat
    await world.sandbox(chat, "provisioning", "compute", eta_seconds=7)
    for path in ("/v1/sandbox/{}/status", "/api/v1/sandbox/{}/status"):
        ok = await client.get(path.format(chat), headers={"Authorization": f"Bearer {key}"})
        assert ok.status_code == 200
        assert ok.json()["etaSeconds"] == 7
        assert (await client.get(path.format(chat))).status_code == 401
        denied = await client.get(path.format("chat_other"), headers={"X-Ivy-Api-Key": key})
        assert denied.status_code == 403


async def test_openapi_describes_status_endpoint_as_the_seed_page_does(
    client: httpx.AsyncClient,
) -> None:
    document = (await client.get("/openapi.json")).json()
    assert "/v1/sandbox/{chatId}/status" in document["paths"]
    assert not any(path.startswith("/api/") for path in document["paths"])
    operation = document["paths"]["/v1/sandbox/{chatId}/status"]["get"]
    assert operation["summary"] == "Get sandbox status"
    assert operation["description"].startswith("Returns the current state of your chat's sandbox.")
    params = {p["name"]: p for p in operation["parameters"]}
    assert set(params) == {"chatId", "prefer", "since"}  # the latter two: optional long-poll
    assert not params["prefer"]["required"]
    assert not params["since"]["required"]
    param = params["chatId"]
    assert (param["name"], param["in"], param["required"]) == ("chatId", "path", True)
    assert param["description"] == "ID of the chat that owns the sandbox"
    assert param["schema"]["type"] == "string"
    responses = operation["responses"]
    assert set(responses) == {"200", "401", "403", "429"}
    assert responses["200"]["description"] == "Current sandbox state"
    assert responses["401"]["description"] == "Authentication required"
    assert (
        responses["403"]["description"]
        == "You do not own this chat, or your key's project scope excludes it"
    )
    assert responses["429"]["description"] == "Rate limit exceeded"
    ref = responses["200"]["content"]["application/json"]["schema"]["$ref"]
    schema = document["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert schema["type"] == "object"
    assert schema["required"] == ["status"]
    props = schema["properties"]
    assert set(props) == {"status", "phase", "etaSeconds", "errorMessage", "createdAt"}
    assert props["status"]["enum"] == ["none", "provisioning", "active", "failed"]
    assert props["phase"]["enum"] == ["compute", "mount", "ready", "failed"]
    assert props["etaSeconds"]["type"] == "integer"
    assert props["errorMessage"]["type"] == "string"
    assert (props["createdAt"]["type"], props["createdAt"]["format"]) == ("string", "date-time")
    for code in ("401", "403", "429"):
        problem = responses[code]["content"]["application/problem+json"]["schema"]
        assert problem["$ref"] == "#/components/schemas/Problem"
    assert document["components"]["schemas"]["Problem"]["type"] == "object"
    schemes = document["components"]["securitySchemes"]
    assert schemes["apiKeyHeader"]["name"] == "X-Ivy-Api-Key"
    assert (schemes["sessionCookie"]["in"], schemes["sessionCookie"]["name"]) == (
        "cookie",
        "__session",
    )
    assert schemes["bearerAuth"]["scheme"] == "bearer"
    assert json.dumps(document).count("HTTPValidationError") == 0

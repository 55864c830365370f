"""What an operator needs when things go wrong: health, readiness, metrics, request ids, logs."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import httpx
import pytest

from conftest import World, metric
from fakes import WallClock
from ivy_sandbox.bootstrap import Services
from ivy_sandbox.logs import REQUEST_ID, JsonFormatter, RequestIdFilter
from ivy_sandbox.storage.engine import create_engine
from ivy_sandbox.storage.repository import Repository


async def test_healthz_answers_without_credentials(client: httpx.AsyncClient) -> None:
    response = await client.get("/healthz")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})


async def test_readyz_reports_each_check(client: httpx.AsyncClient) -> None:
    response = await client.get("/readyz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "checks": {"database": "ok", "backend": "ok"}}


async def test_readyz_is_503_with_retry_after_when_the_database_is_unreachable(
    client: httpx.AsyncClient, services: Services
) -> None:
    broken = Repository(create_engine("postgresql+asyncpg://nobody@127.0.0.1:1/none"))
    original, services.repository = services.repository, broken
    try:
        response = await client.get("/readyz")
    finally:
        services.repository = original
        await broken.engine.dispose()
    assert response.status_code == 503
    assert response.headers["retry-after"] == "5"
    assert response.json()["checks"] == {"database": "unavailable", "backend": "ok"}


async def test_status_requests_are_counted_by_route_template_not_by_chat_id(
    client: httpx.AsyncClient, world: World
) -> None:
    key, chat = await world.key(), await world.chat()
    route = "/v1/sandbox/{chatId}/status"
    before = (await client.get("/metrics")).text
    for _ in range(3):
        await client.get(f"/v1/sandbox/{chat}/status", headers={"X-Ivy-Api-Key": key})
    await client.get(f"/v1/sandbox/{chat}/status")
    after = (await client.get("/metrics")).text
    ok = {"route": route, "method": "GET", "code": "200"}
    assert (
        metric(after, "ivy_http_requests_total", **ok)
        - metric(before, "ivy_http_requests_total", **ok)
        == 3
    )
    denied = {"route": route, "method": "GET", "code": "401"}
    assert (
        metric(after, "ivy_http_requests_total", **denied)
        - metric(before, "ivy_http_requests_total", **denied)
        == 1
    )
    assert metric(after, "ivy_auth_failures_total") - metric(before, "ivy_auth_failures_total") == 1
    assert chat not in after


async def test_rate_limited_requests_are_counted_by_policy(
    client: httpx.AsyncClient, world: World, services: Services
) -> None:
    from ivy_sandbox.ratelimit import RateLimiter, make_storage

    services.limiter = RateLimiter(
        make_storage(None), per_user="1000/minute", per_chat="1/minute", auth_failures="100/minute"
    )
    key, chat = await world.key(), await world.chat()
    before = metric((await client.get("/metrics")).text, "ivy_rate_limited_total", policy="chat")
    for _ in range(3):
        await client.get(f"/v1/sandbox/{chat}/status", headers={"X-Ivy-Api-Key": key})
    after = metric((await client.get("/metrics")).text, "ivy_rate_limited_total", policy="chat")
    assert after - before == 2


async def test_sandbox_gauges_come_from_the_database(
    client: httpx.AsyncClient, world: World
) -> None:
    for status, phase in (("active", "ready"), ("active", "ready"), ("failed", "failed")):
        await world.sandbox(await world.chat(), status, phase)
    text = (await client.get("/metrics")).text
    assert metric(text, "ivy_sandboxes", status="active") == 2
    assert metric(text, "ivy_sandboxes", status="failed") == 1
    assert metric(text, "ivy_sandboxes", status="provisioning") == 0


async def test_metrics_require_the_token_when_one_is_configured(
    client: httpx.AsyncClient, services: Services
) -> None:
    services.settings = services.settings.model_copy(update={"metrics_token": "s3cret-token"})
    assert (await client.get("/metrics")).status_code == 401
    wrong = await client.get("/metrics", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    right = await client.get("/metrics", headers={"Authorization": "Bearer s3cret-token"})
    assert right.status_code == 200
    assert "ivy_http_requests_total" in right.text


async def test_every_response_carries_a_request_id_and_a_sane_one_is_kept(
    client: httpx.AsyncClient,
) -> None:
    generated = (await client.get("/healthz")).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", generated)
    kept = await client.get("/healthz", headers={"X-Request-Id": "trace-123.abc"})
    assert kept.headers["x-request-id"] == "trace-123.abc"
    replaced = await client.get("/healthz", headers={"X-Request-Id": "x" * 200})
    assert replaced.headers["x-request-id"] != "x" * 200
    unauthenticated = await client.get("/v1/sandbox/chat_x/status")
    assert unauthenticated.headers["x-request-id"]


def test_json_log_lines_carry_the_request_id_and_extra_fields() -> None:
    record = logging.LogRecord(
        "ivy_sandbox.api", logging.INFO, "f.py", 1, "hello %s", ("you",), None
    )
    record.sandbox_id = "sbx_1"
    token = REQUEST_ID.set("req-42")
    try:
        RequestIdFilter().filter(record)
    finally:
        REQUEST_ID.reset(token)
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "hello you"
    assert line["request_id"] == "req-42"
    assert line["level"] == "info"
    assert line["sandbox_id"] == "sbx_1"


class TestLaunchMetrics:
    @pytest.fixture
    def clock(self) -> WallClock:  # type: ignore[override]
        return WallClock()

    @pytest.mark.usefixtures("worker")
    async def test_launch_outcomes_and_phase_durations_are_recorded(
        self, client: httpx.AsyncClient, world: World
    ) -> None:
        key, chat = await world.key(), await world.chat()
        before = (await client.get("/metrics")).text
        await client.post(f"/v1/sandbox/{chat}", headers={"X-Ivy-Api-Key": key})
        launched = {"outcome": "active", "error_code": ""}
        # The worker counts the launch just after committing `active`, so a client can see
        # `active` a moment before the counter moves: wait for both.
        for _ in range(200):
            status = await client.get(f"/v1/sandbox/{chat}/status", headers={"X-Ivy-Api-Key": key})
            after = (await client.get("/metrics")).text
            counted = metric(after, "ivy_launches_total", **launched) > metric(
                before, "ivy_launches_total", **launched
            )
            if status.json()["status"] == "active" and counted:
                break
            await asyncio.sleep(0.01)
        assert (
            metric(after, "ivy_launches_total", **launched)
            - metric(before, "ivy_launches_total", **launched)
            == 1
        )
        for phase in ("compute", "mount", "ready"):
            labels = {"backend": "fake", "phase": phase}
            count = "ivy_phase_duration_seconds_count"
            assert metric(after, count, **labels) - metric(before, count, **labels) == 1

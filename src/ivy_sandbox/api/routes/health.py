"""Operator endpoints: liveness, readiness and Prometheus metrics (no user authentication;
``/metrics`` takes a bearer token when ``IVY_METRICS_TOKEN`` is set)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ivy_sandbox.api.deps import ServicesDep
from ivy_sandbox.errors import AuthenticationFailed
from ivy_sandbox.metrics import REGISTRY
from ivy_sandbox.services import health

router = APIRouter(tags=["operations"])

# An excerpt of a real scrape, so an operator sees the metric names and labels up front.
METRICS_EXAMPLE = """\
# HELP ivy_http_requests_total HTTP requests answered, by route template, method and status code.
# TYPE ivy_http_requests_total counter
ivy_http_requests_total{code="200",method="GET",route="/v1/sandbox/{chatId}/status"} 1523.0
ivy_http_requests_total{code="202",method="POST",route="/v1/sandbox/{chatId}"} 41.0
# HELP ivy_launches_total Launches driven to an end by this process, by outcome and errorCode.
# TYPE ivy_launches_total counter
ivy_launches_total{error_code="",outcome="active"} 39.0
ivy_launches_total{error_code="mount_failed",outcome="failed"} 2.0
# HELP ivy_sandboxes Sandboxes by status, read from the database at scrape time.
# TYPE ivy_sandboxes gauge
ivy_sandboxes{status="active"} 12.0
ivy_sandboxes{status="provisioning"} 1.0
"""


@router.get(
    "/healthz",
    summary="Liveness",
    description="200 while the process runs and answers; checks nothing else.",
    operation_id="healthz",
    responses={
        200: {
            "description": "Alive",
            "content": {"application/json": {"example": {"status": "ok"}}},
        }
    },
)
async def healthz() -> JSONResponse:
    return JSONResponse({"status": "ok"})


@router.get(
    "/readyz",
    summary="Readiness",
    description=(
        "200 when the database answers and the sandbox backend is usable; 503 otherwise, "
        "with `Retry-After` and which check failed (no internal details)."
    ),
    operation_id="readyz",
    responses={
        200: {
            "description": "Ready",
            "content": {
                "application/json": {
                    "example": {"status": "ok", "checks": {"database": "ok", "backend": "ok"}}
                }
            },
        },
        503: {"description": "Not ready"},
    },
)
async def readyz(services: ServicesDep) -> JSONResponse:
    checks = await health.readiness(services.repository, services.backend)
    ok = all(value == "ok" for value in checks.values())
    body: dict[str, Any] = {"status": "ok" if ok else "unavailable", "checks": checks}
    if ok:
        return JSONResponse(body)
    return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    description=(
        "Requests by route and code, launches by outcome and errorCode, phase durations, "
        "sandboxes by status, rate-limited and authentication-failure counters. Requires "
        "`Authorization: Bearer $IVY_METRICS_TOKEN` when that setting is set."
    ),
    operation_id="metrics",
    response_class=Response,
    responses={
        200: {
            "description": "Prometheus text format",
            "content": {"text/plain": {"schema": {"type": "string"}, "example": METRICS_EXAMPLE}},
        }
    },
)
async def metrics(request: Request, services: ServicesDep) -> Response:
    expected = services.settings.metrics_token
    if expected:
        given = request.headers.get("authorization", "")
        if not health.token_matches(given, expected):
            raise AuthenticationFailed("metrics token missing or wrong")
    await health.refresh_sandbox_gauges(services.sandboxes)
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

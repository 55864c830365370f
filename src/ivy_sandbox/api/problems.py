"""The one place where errors become HTTP responses (``application/problem+json``).

Body: ``type``, ``title``, ``status``, ``detail`` and a stable ``code``. The body never holds
a secret; the log line carries the operator-facing reason (never the credential).
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from ivy_sandbox.errors import (
    ApiError,
    AuthenticationFailed,
    RateLimited,
    ServiceUnavailable,
)
from ivy_sandbox.metrics import AUTH_FAILURES, RATE_LIMITED
from ivy_sandbox.ratelimit import rate_limit_headers

log = logging.getLogger("ivy_sandbox.api")

PROBLEM_JSON = "application/problem+json"
_GENERIC_CODES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}


def problem_response(
    status: int, code: str, title: str, detail: str, headers: dict[str, str] | None = None
) -> Response:
    body = {
        "type": f"urn:ivy-sandbox:error:{code}",
        "title": title,
        "status": status,
        "detail": detail,
        "code": code,
    }
    return Response(
        json.dumps(body, separators=(",", ":")),
        status_code=status,
        media_type=PROBLEM_JSON,
        headers=headers,
    )


def api_error_response(error: ApiError) -> Response:
    headers: dict[str, str] = {}
    if isinstance(error, AuthenticationFailed):
        AUTH_FAILURES.inc()
        challenge = 'Bearer realm="ivy"'
        if error.credential_sent:
            challenge += ', error="invalid_token"'
        headers["WWW-Authenticate"] = challenge
    elif isinstance(error, RateLimited):
        RATE_LIMITED.labels(error.state.policy_name).inc()
        headers.update(rate_limit_headers(error.state))
    elif isinstance(error, ServiceUnavailable):
        headers["Retry-After"] = str(error.retry_after_seconds)
    return problem_response(error.status_code, error.code, error.title, error.detail, headers)


async def _on_api_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, ApiError)
    return logged_api_error_response(request.method, request.url.path, error)


AllowedMethods = Callable[[str], list[str]]


def _http_exception_handler(allowed: AllowedMethods) -> Callable[..., Awaitable[Response]]:
    async def on_http_exception(request: Request, error: Exception) -> Response:
        assert isinstance(error, StarletteHTTPException)
        if error.status_code == 400:
            # FastAPI's answer to a body it cannot parse as JSON: bad input is a documented 422.
            return problem_response(
                422,
                "invalid_request",
                "Unprocessable Content",
                "The request body is not valid JSON.",
            )
        code = _GENERIC_CODES.get(error.status_code, "http_error")
        detail = error.detail if isinstance(error.detail, str) else "Request failed."
        headers = dict(error.headers or {})
        if error.status_code == 405:
            # Starlette names only the first matching route's methods; a resource served by
            # several routes (GET/POST/DELETE /v1/sandbox/{chatId}) supports all of theirs.
            headers["Allow"] = ", ".join(allowed(request.url.path)) or headers.get("Allow", "")
        return problem_response(error.status_code, code, detail, detail, headers)

    return on_http_exception


async def _on_validation_error(_request: Request, error: Exception) -> Response:
    assert isinstance(error, RequestValidationError)
    fields = ", ".join(".".join(str(p) for p in e["loc"]) for e in error.errors()[:5])
    return problem_response(
        422, "invalid_request", "Unprocessable Content", f"Invalid request: check {fields}."
    )


# Connection-level failures only; an IntegrityError is a bug or a conflict, not an outage.
DATABASE_ERRORS: tuple[type[Exception], ...] = (
    OperationalError,
    InterfaceError,
    PoolTimeoutError,
    OSError,
    sqlite3.OperationalError,  # the SQLite fast read (storage.sqlite_reads)
)


def logged_api_error_response(method: str, path: str, error: ApiError) -> Response:
    log.info("%s %s -> %d %s: %s", method, path, error.status_code, error.code, error.log_message)
    return api_error_response(error)


def database_error_response(method: str, path: str, error: Exception) -> Response:
    log.error("database unavailable during %s %s: %s", method, path, type(error).__name__)
    return api_error_response(ServiceUnavailable("database unavailable"))


async def _on_database_error(request: Request, error: Exception) -> Response:
    return database_error_response(request.method, request.url.path, error)


def unexpected_error_response(method: str, path: str) -> Response:
    """500 for a bug; call it inside the ``except`` block (the log carries the traceback)."""
    log.exception("unhandled error during %s %s", method, path)
    return problem_response(
        500, "internal_error", "Internal Server Error", "The server could not complete the request."
    )


async def _on_unexpected(request: Request, _error: Exception) -> Response:
    return unexpected_error_response(request.method, request.url.path)


def install_error_handlers(app: FastAPI, allowed_methods: AllowedMethods) -> None:
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(StarletteHTTPException, _http_exception_handler(allowed_methods))
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    for db_error in DATABASE_ERRORS:
        app.add_exception_handler(db_error, _on_database_error)
    app.add_exception_handler(Exception, _on_unexpected)

"""The seed endpoint's hot path, answered in front of FastAPI's whole stack.

`GET /v1/sandbox/{chatId}/status` is polled once a second by every launching client, so its
cost is the service's cost. Profiling showed FastAPI's per-request work (routing through
included routers, dependency resolution, parameter validation) costing more than the
authentication, rate limiting and database read together; and, once that was bypassed, the
middleware layers (Starlette's error middleware, FastAPI's, ours for request ids, security
headers and body limits: one ``send`` wrapper each) costing about a fifth of what was left.

So :class:`FastStatus` is called by the app itself (``IvyApp.__call__``) before any of that,
and does for the plain poll exactly what the full stack would: the same authentication
(``deps.authenticate_caller``), use case (``services.sandboxes.get_status``) and error
mapping (``problems``); the same request id, security headers and metrics as
``ObservabilityMiddleware`` and ``SecurityHeadersMiddleware``. Anything else goes to
FastAPI: long-polls (a ``Prefer`` header), ids containing ``/``, other methods and paths,
requests carrying a body or oversized headers (the body-limit middleware answers those).
The FastAPI route stays the documented, canonical one; tests run the same contract against
both (tests/api/test_fast_status.py).
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from starlette.responses import Response
from starlette.types import Scope, Send

from ivy_sandbox.api.deps import authenticate_caller
from ivy_sandbox.api.middleware import SECURITY_HEADERS
from ivy_sandbox.api.observability import VALID_REQUEST_ID, request_id_of
from ivy_sandbox.api.problems import (
    DATABASE_ERRORS,
    database_error_response,
    logged_api_error_response,
    unexpected_error_response,
)
from ivy_sandbox.bootstrap import Services
from ivy_sandbox.domain.sandbox import StatusBody
from ivy_sandbox.errors import ApiError
from ivy_sandbox.logs import REQUEST_ID
from ivy_sandbox.metrics import HTTP_LATENCY, HTTP_REQUESTS
from ivy_sandbox.services import sandboxes

_STATUS_PATH = re.compile(r"^(/api)?/v1/sandbox/([^/]*)/status$")
_ROUTES = {False: "/v1/sandbox/{chatId}/status", True: "/api/v1/sandbox/{chatId}/status"}
_WANTED = frozenset({b"authorization", b"x-ivy-api-key", b"cookie"})
# Present on a request the full stack must see: a long-poll, or a body to limit.
_TO_FASTAPI = frozenset({b"prefer", b"content-length", b"transfer-encoding"})
MAX_MEMOISED_BODIES = 4096
_OK_HEADERS = [(b"content-type", b"application/json"), *SECURITY_HEADERS]


class FastStatus:
    """Answers the plain status poll, or declines (returns False) and lets FastAPI answer."""

    def __init__(self, max_header_bytes: int) -> None:
        self.max_header_bytes = max_header_bytes
        self._latency = {alias: HTTP_LATENCY.labels(route) for alias, route in _ROUTES.items()}
        self._counters: dict[tuple[bool, int], Any] = {}
        self._payloads: dict[tuple[tuple[str, Any], ...], bytes] = {}

    async def answer(self, scope: Scope, send: Send, services: Services) -> bool:
        match = _STATUS_PATH.match(scope["path"])
        if match is None:
            return False
        wanted: dict[bytes, str] = {}
        request_id = None
        header_bytes = 0
        for name, value in scope["headers"]:
            header_bytes += len(name) + len(value)
            if name in _WANTED:
                # Like Starlette's Headers.get: the first occurrence wins.
                wanted.setdefault(name, value.decode("latin-1"))
            elif name in _TO_FASTAPI:
                return False
            elif name == b"x-request-id" and VALID_REQUEST_ID.fullmatch(value):
                request_id = value
        if header_bytes > self.max_header_bytes:
            return False  # the body-limit middleware answers 431
        alias = match.group(1) is not None
        started = time.perf_counter()
        request_id_text = request_id_of(request_id)
        token = REQUEST_ID.set(request_id_text)
        status = 500
        try:
            status, headers, payload = await self._respond(scope, services, match.group(2), wanted)
            headers.append((b"x-request-id", request_id_text.encode()))
            await send({"type": "http.response.start", "status": status, "headers": headers})
            self._latency[alias].observe(time.perf_counter() - started)
            await send({"type": "http.response.body", "body": payload})
        finally:
            self._count(alias, status)
            REQUEST_ID.reset(token)
        return True

    async def _respond(
        self, scope: Scope, services: Services, chat_id: str, headers: dict[bytes, str]
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        client = scope.get("client")
        try:
            principal = await authenticate_caller(
                services,
                headers.get(b"authorization"),
                headers.get(b"x-ivy-api-key"),
                headers.get(b"cookie"),
                client[0] if client else "unknown",
            )
            body = await sandboxes.get_status(
                chat_id,
                principal,
                repository=services.repository,
                limiter=services.limiter,
                clock=services.clock,
            )
        except ApiError as error:
            return _parts(logged_api_error_response("GET", scope["path"], error))
        except DATABASE_ERRORS as error:
            return _parts(database_error_response("GET", scope["path"], error))
        except Exception:  # what Starlette's error middleware would answer
            return _parts(unexpected_error_response("GET", scope["path"]))
        payload = self._encode(body)
        return 200, [*_OK_HEADERS, (b"content-length", str(len(payload)).encode())], payload

    def _encode(self, body: StatusBody) -> bytes:
        """JSON, memoised by content: most polls see a body they have seen before."""
        key = tuple(body.items())
        payload = self._payloads.get(key)
        if payload is None:
            if len(self._payloads) >= MAX_MEMOISED_BODIES:
                self._payloads.clear()
            payload = self._payloads[key] = json.dumps(body, separators=(",", ":")).encode()
        return payload

    def _count(self, alias: bool, status: int) -> None:
        counter = self._counters.get((alias, status))
        if counter is None:
            counter = HTTP_REQUESTS.labels(_ROUTES[alias], "GET", str(status))
            self._counters[(alias, status)] = counter
        counter.inc()


def _parts(response: Response) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    headers = [(k, v) for k, v in response.raw_headers if k != b"cache-control"]
    return response.status_code, [*headers, *SECURITY_HEADERS], bytes(response.body)

"""Request ids and HTTP metrics, as one pure ASGI middleware (cheap on the hot path)."""

from __future__ import annotations

import os
import re
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ivy_sandbox.logs import REQUEST_ID
from ivy_sandbox.metrics import HTTP_LATENCY, HTTP_REQUESTS

VALID_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,64}")
UNMATCHED = "<unmatched>"


def request_id_of(valid_from_caller: bytes | None) -> str:
    """The caller's (already validated) request id, else a new random one (32 hex digits;
    ``os.urandom`` rather than ``uuid4``: same entropy, a third of the cost)."""
    if valid_from_caller is not None:
        return valid_from_caller.decode()
    return os.urandom(16).hex()


def route_label(scope: Scope) -> str:
    """The route template (``/v1/sandbox/{chatId}/status``), never the raw path: chat ids
    must not become label values (unbounded cardinality, and they are user data)."""
    # FastAPI ≥ 0.16x resolves included routers lazily: the matched route keeps its own path
    # and the prefixed one lives in the effective route context. Older versions: the route.
    context: Any = (scope.get("fastapi") or {}).get("effective_route_context")
    route: Any = scope.get("route")
    for candidate in (context, route):
        path = getattr(candidate, "path_format", None)
        if path:
            return str(path)
    return UNMATCHED


class ObservabilityMiddleware:
    """Gives every request an id (``X-Request-Id``: the caller's if sane, else a new one),
    sets it for the logs, and counts the request by route template, method and status."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        from_caller = None
        for name, value in scope["headers"]:
            if name == b"x-request-id" and VALID_REQUEST_ID.fullmatch(value):
                from_caller = value
        request_id = request_id_of(from_caller)
        token = REQUEST_ID.set(request_id)
        started = time.perf_counter()
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [
                    *message.get("headers", []),
                    (b"x-request-id", request_id.encode()),
                ]
                HTTP_LATENCY.labels(route_label(scope)).observe(time.perf_counter() - started)
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            HTTP_REQUESTS.labels(route_label(scope), scope["method"], str(status)).inc()
            REQUEST_ID.reset(token)

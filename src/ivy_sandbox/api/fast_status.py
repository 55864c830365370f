"""The seed endpoint's hot path, answered below FastAPI's routing and dependency machinery.

`GET /v1/sandbox/{chatId}/status` is polled once a second by every launching client, so its
cost is the service's cost. Profiling showed FastAPI's per-request work (routing through
included routers, dependency resolution, parameter validation) costing more than the
authentication, rate limiting and database read together. This ASGI layer answers the
plain poll itself — same authentication (``deps.authenticate_caller``), same use case
(``services.sandboxes.get_status``), same error mapping (``problems``) — and hands
everything else to FastAPI: long-polls (a ``Prefer`` header), ids containing ``/``, other
methods and paths. The FastAPI route stays the documented, canonical one; tests run the
same contract against both (tests/api/test_fast_status.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from ivy_sandbox.api.deps import authenticate_caller
from ivy_sandbox.api.problems import (
    DATABASE_ERRORS,
    database_error_response,
    logged_api_error_response,
)
from ivy_sandbox.errors import ApiError
from ivy_sandbox.services import sandboxes

_STATUS_PATH = re.compile(r"^(/api)?/v1/sandbox/([^/]*)/status$")


class _Template:
    """What the metrics middleware reads as the route template (see observability)."""

    def __init__(self, path_format: str) -> None:
        self.path_format = path_format


_TEMPLATES = {
    False: _Template("/v1/sandbox/{chatId}/status"),
    True: _Template("/api/v1/sandbox/{chatId}/status"),
}
_JSON_HEADERS = [(b"content-type", b"application/json")]


class FastStatusMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "GET":
            await self.app(scope, receive, send)
            return
        match = _STATUS_PATH.match(scope["path"])
        if match is None:
            await self.app(scope, receive, send)
            return
        wanted: dict[bytes, str] = {}
        for name, value in scope["headers"]:
            if name in (b"authorization", b"x-ivy-api-key", b"cookie", b"prefer"):
                # Like Starlette's Headers.get: the first occurrence wins.
                wanted.setdefault(name, value.decode("latin-1"))
        if b"prefer" in wanted:  # a long-poll: FastAPI's route handles it
            await self.app(scope, receive, send)
            return
        scope["route"] = _TEMPLATES[match.group(1) is not None]
        await self._answer(scope, send, match.group(2), wanted)

    async def _answer(
        self, scope: Scope, send: Send, chat_id: str, headers: dict[bytes, str]
    ) -> None:
        services: Any = scope["app"].state.services
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
            response = logged_api_error_response("GET", scope["path"], error)
            await response(scope, _no_receive, send)
            return
        except DATABASE_ERRORS as error:
            response = database_error_response("GET", scope["path"], error)
            await response(scope, _no_receive, send)
            return
        payload = json.dumps(body, separators=(",", ":")).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [*_JSON_HEADERS, (b"content-length", str(len(payload)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": payload})


async def _no_receive() -> Any:  # responses never read the request
    return {"type": "http.disconnect"}

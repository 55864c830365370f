"""Pure ASGI middleware (no BaseHTTPMiddleware: it costs a task and a copy per request)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

SECURITY_HEADERS: list[tuple[bytes, bytes]] = [
    (b"cache-control", b"no-store"),
    (b"x-content-type-options", b"nosniff"),
]


class SecurityHeadersMiddleware:
    """Adds ``Cache-Control: no-store`` and ``X-Content-Type-Options: nosniff`` to every response.

    Status bodies change second by second and carry per-user data: no cache may keep them.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"cache-control"]
                headers.extend(SECURITY_HEADERS)
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_headers)

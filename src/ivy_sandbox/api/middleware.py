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


class BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """Refuse request bodies over ``max_bytes`` with 413, before they are buffered whole,
    and header sections over ``max_header_bytes`` with 431.

    A declared Content-Length over the limit is refused at once; a chunked body is counted
    as it streams and refused as soon as it passes the limit.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, max_header_bytes: int = 16 * 1024) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # uvicorn accepts headers of any size; a megabyte of cookie is refused here (431).
        if sum(len(name) + len(value) for name, value in scope["headers"]) > self.max_header_bytes:
            await self._refuse(send, 431)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and (not value.isdigit() or int(value) > self.max_bytes):
                await self._refuse(send)
                return
        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._refuse(send)

    async def _refuse(self, send: Send, status: int = 413) -> None:
        from ivy_sandbox.api.problems import problem_response

        if status == 431:
            response = problem_response(
                431,
                "headers_too_large",
                "Request Header Fields Too Large",
                f"The request headers are larger than {self.max_header_bytes} bytes.",
            )
        else:
            response = problem_response(
                413,
                "payload_too_large",
                "Content Too Large",
                f"The request body is larger than {self.max_bytes} bytes.",
            )
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    *response.raw_headers,
                    *SECURITY_HEADERS,
                ],
            }
        )
        await send({"type": "http.response.body", "body": response.body})

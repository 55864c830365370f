"""The synchronous client."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import quote

import httpx

from ivy_sandbox.client.errors import (
    APIStatusError,
    AuthenticationError,
    ConflictError,
    IvySandboxClientError,
    PermissionDeniedError,
    RateLimitError,
    SandboxFailedError,
    TimeoutError,
)

DEFAULT_URL = "http://127.0.0.1:8000"
POLL_SECONDS = 1.0  # the seed page: "poll about once per second or two"
TERMINAL = {"active", "failed", "none"}

Body = dict[str, Any]


def raise_for_problem(response: httpx.Response) -> None:
    """Turn an error answer into the SDK's typed error."""
    if response.is_success:
        return
    try:
        problem = response.json()
    except ValueError:
        problem = {}
    code = str(problem.get("code", "http_error"))
    detail = str(problem.get("detail", response.reason_phrase))
    status = response.status_code
    if status == 401:
        raise AuthenticationError(status, code, detail)
    if status == 403:
        raise PermissionDeniedError(status, code, detail)
    if status == 409:
        raise ConflictError(status, code, detail)
    if status == 429:
        retry_after = float(response.headers.get("retry-after", "1") or 1)
        raise RateLimitError(status, code, detail, retry_after)
    raise APIStatusError(status, code, detail)


def resolve_config(base_url: str | None, api_key: str | None) -> tuple[str, str]:
    url = base_url or os.environ.get("IVY_API_URL") or DEFAULT_URL
    key = api_key or os.environ.get("IVY_API_KEY")
    if not key:
        raise IvySandboxClientError("no API key: pass api_key= or set IVY_API_KEY")
    return url.rstrip("/"), key


def sandbox_path(chat_id: str, suffix: str = "") -> str:
    return f"/v1/sandbox/{quote(chat_id, safe='')}{suffix}"


class SandboxAPI:
    def __init__(self, client: Client) -> None:
        self._client = client

    def status(self, chat_id: str) -> Body:
        return self._client.request("GET", sandbox_path(chat_id, "/status"))

    def get(self, chat_id: str) -> Body:
        return self._client.request("GET", sandbox_path(chat_id))

    def launch(self, chat_id: str) -> Body:
        return self._client.request("POST", sandbox_path(chat_id))

    def stop(self, chat_id: str) -> Body:
        return self._client.request("DELETE", sandbox_path(chat_id))

    def keep_alive(self, chat_id: str) -> Body:
        return self._client.request("POST", sandbox_path(chat_id, "/keepalive"))

    def exec(
        self,
        chat_id: str,
        command: Sequence[str],
        *,
        timeout_seconds: float = 60.0,
        cwd: str = "/workspace",
        env: Mapping[str, str] | None = None,
        stdin: str = "",
    ) -> Body:
        body = {
            "command": list(command),
            "timeoutSeconds": timeout_seconds,
            "cwd": cwd,
            "env": dict(env or {}),
            "stdin": stdin,
        }
        return self._client.request(
            "POST", sandbox_path(chat_id, "/exec"), json=body, timeout=timeout_seconds + 30
        )

    def wait_until_ready(
        self,
        chat_id: str,
        *,
        timeout: float = 300.0,
        on_progress: Callable[[Body], None] | None = None,
    ) -> Body:
        """Poll the status (once a second, honouring Retry-After) until the sandbox is active.

        Raises SandboxFailedError when it fails, TimeoutError after ``timeout`` seconds, and
        IvySandboxClientError if the chat has no sandbox (launch it first).
        """
        deadline = time.monotonic() + timeout
        last: Body | None = None
        while True:
            try:
                body = self.status(chat_id)
            except RateLimitError as limited:
                self._client.sleep(min(limited.retry_after, max(0.0, deadline - time.monotonic())))
                body = last or {}
            if body and body != last and on_progress is not None:
                on_progress(body)
            last = body or last
            state = body.get("status")
            if state == "active":
                return body
            if state == "failed":
                detail = self.get(chat_id)
                raise SandboxFailedError(detail.get("errorCode"), str(body.get("errorMessage", "")))
            if state == "none":
                raise IvySandboxClientError(f"chat {chat_id} has no sandbox; launch it first")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"sandbox for {chat_id} not ready after {timeout:g} s")
            self._client.sleep(min(POLL_SECONDS, max(0.0, deadline - time.monotonic())))


class Client:
    """A synchronous client. ``transport`` lets tests run against the app in-process."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        transport: httpx.BaseTransport | None = None,
        timeout: float = 30.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        url, key = resolve_config(base_url, api_key)
        self._http = httpx.Client(
            base_url=url,
            headers={"Authorization": f"Bearer {key}", "User-Agent": "ivy-sandbox-python"},
            transport=transport,
            timeout=timeout,
        )
        self.sleep = sleep
        self.sandbox = SandboxAPI(self)

    def request(self, method: str, path: str, **kwargs: Any) -> Body:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise IvySandboxClientError(f"cannot reach {self._http.base_url}: {exc}") from exc
        raise_for_problem(response)
        body: Body = response.json()
        return body

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

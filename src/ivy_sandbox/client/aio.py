"""The asynchronous client: ``await``-based I/O around the shared logic of ``_protocol``."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import aclosing
from typing import Any, Generic, TypeVar

import httpx

from ivy_sandbox.client import _protocol as p
from ivy_sandbox.client.types import ExecResult, SandboxDetail, StatusBody

__all__ = ["AsyncClient", "AsyncSandbox"]

T = TypeVar("T")


class _Result(Generic[T]):
    """Where :func:`drive` leaves the steps' result (an async generator cannot return one)."""

    value: T


def _build(http: httpx.AsyncClient, call: p.Call) -> httpx.Request:
    return http.build_request(
        call.method,
        call.path,
        headers=dict(call.headers),
        params=dict(call.params),
        json=call.json,
        timeout=httpx.USE_CLIENT_DEFAULT if call.timeout is None else call.timeout,
    )


async def _within(seconds: float | None, awaitable: Awaitable[T]) -> T:
    """Await with the stream's read timeout also enforced here: a transport may ignore it
    (``httpx.ASGITransport`` does)."""
    if seconds is None:
        return await awaitable
    try:
        async with asyncio.timeout(seconds):
            return await awaitable
    except TimeoutError as exc:
        raise httpx.ReadTimeout(f"no data within {seconds:g} s") from exc


async def drive(
    steps: p.Steps[T],
    http: httpx.AsyncClient,
    sleep: Callable[[float], Awaitable[None]],
    result: _Result[T] | None = None,
) -> AsyncGenerator[StatusBody, None]:
    """Perform ``steps``' effects with ``await``; yields what they emit and stores their result
    in ``result``. Any stream still open is closed when this ends, however it ends."""
    stream: httpx.Response | None = None
    chunks: AsyncIterator[bytes] | None = None
    read_timeout: float | None = None
    answer: Any = None
    failure: BaseException | None = None

    async def close_stream() -> None:
        nonlocal stream, chunks
        if stream is not None:
            await stream.aclose()
        stream, chunks = None, None

    try:
        while True:
            try:
                effect = steps.throw(failure) if failure is not None else steps.send(answer)
            except StopIteration as done:
                if result is not None:
                    result.value = done.value
                return
            answer, failure = None, None
            try:
                if isinstance(effect, p.Emit):
                    yield effect.body
                elif isinstance(effect, p.Sleep):
                    await sleep(effect.seconds)
                elif isinstance(effect, p.Call):
                    answer = await http.send(_build(http, effect))
                elif isinstance(effect, p.OpenStream):
                    await close_stream()
                    read_timeout = effect.call.timeout
                    request = _build(http, effect.call)
                    response = await _within(read_timeout, http.send(request, stream=True))
                    if p.wants_body(response):
                        try:
                            await response.aread()
                        finally:
                            await response.aclose()
                    else:
                        stream, chunks = response, response.aiter_bytes()
                    answer = response
                elif isinstance(effect, p.Receive):
                    assert chunks is not None, "Receive without an open stream"
                    answer = await _within(read_timeout, anext(chunks, b""))
                elif isinstance(effect, p.CloseStream):
                    await close_stream()
            except httpx.HTTPError as exc:
                failure = exc
    finally:
        await close_stream()
        steps.close()


async def run(
    steps: p.Steps[T], http: httpx.AsyncClient, sleep: Callable[[float], Awaitable[None]]
) -> T:
    """Run steps that emit nothing (plain requests) to their result."""
    result: _Result[T] = _Result()
    async with aclosing(drive(steps, http, sleep, result)) as driven:
        async for _ in driven:
            pass
    return result.value


class AsyncSandbox:
    """``client.sandbox``: the sandbox of a chat (awaitable methods)."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def _run(self, steps: p.Steps[T]) -> T:
        return await run(steps, self._client._http, self._client._sleep)

    async def status(self, chat_id: str) -> StatusBody:
        """The status body (``GET /v1/sandbox/{chatId}/status``)."""
        return await self._run(p.status(chat_id))

    async def get(self, chat_id: str) -> SandboxDetail:
        """The full record: status fields, ``errorCode``, phase timeline, times, queueing."""
        return await self._run(p.detail(chat_id))

    async def launch(self, chat_id: str) -> StatusBody:
        """Launch (idempotent while provisioning or active); returns at once with the status."""
        return await self._run(p.launch(chat_id))

    async def stop(self, chat_id: str) -> StatusBody:
        """Stop from any state (the workspace is kept); returns ``{"status": "none"}``."""
        return await self._run(p.stop(chat_id))

    async def keep_alive(self, chat_id: str) -> StatusBody:
        """Count as activity, so the sandbox is not reaped as idle."""
        return await self._run(p.keep_alive(chat_id))

    async def exec(
        self,
        chat_id: str,
        command: Sequence[str],
        *,
        timeout_seconds: float | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: str | None = None,
    ) -> ExecResult:
        """Run ``command`` in the active sandbox (server defaults: 60 s, ``/workspace``);
        raises :class:`ConflictError` unless it is active."""
        steps = p.exec_command(
            chat_id, command, timeout_seconds=timeout_seconds, cwd=cwd, env=env, stdin=stdin
        )
        return await self._run(steps)

    def events(self, chat_id: str) -> AsyncIterator[StatusBody]:
        """Status bodies from the event stream: the current one, then one per change; ends
        after ``active``, ``failed`` or ``none``. One connection, no fallback. If you stop
        early, close it (``contextlib.aclosing``) to release the connection at once."""
        return drive(p.events(chat_id), self._client._http, self._client._sleep)

    async def wait_until_ready(
        self,
        chat_id: str,
        *,
        timeout: float = 300.0,  # noqa: ASYNC109 - the deadline of the whole wait, as in Client
        on_progress: Callable[[StatusBody], object] | None = None,
    ) -> StatusBody:
        """Wait until the sandbox is ``active`` and return that status body.

        Same behaviour as :meth:`Client.sandbox.wait_until_ready
        <ivy_sandbox.client.sync.SyncSandbox.wait_until_ready>`; ``on_progress`` may also be a
        coroutine function.
        """
        steps = p.wait_until_ready(chat_id, timeout=timeout, clock=self._client._clock)
        result: _Result[StatusBody] = _Result()
        driven = drive(steps, self._client._http, self._client._sleep, result)
        async with aclosing(driven):
            async for body in driven:
                if on_progress is not None:
                    outcome = on_progress(body)
                    if inspect.isawaitable(outcome):
                        await outcome
        return result.value


class AsyncClient:
    """An asynchronous client of the ivy-sandbox API (same arguments as :class:`Client`;
    ``transport`` is an ``httpx.AsyncBaseTransport``, e.g. ``httpx.ASGITransport(app=…)``)."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout: float = 30.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        url, key = p.resolve_config(base_url, api_key)
        self._http = httpx.AsyncClient(
            base_url=url, headers=p.default_headers(key), transport=transport, timeout=timeout
        )
        self._sleep = sleep
        self._clock = clock
        self.sandbox = AsyncSandbox(self)

    @property
    def base_url(self) -> str:
        return str(self._http.base_url).rstrip("/")

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

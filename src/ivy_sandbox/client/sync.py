"""The synchronous client: blocking I/O around the shared logic of ``_protocol``."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from contextlib import closing
from typing import Any, TypeVar

import httpx

from ivy_sandbox.client import _protocol as p
from ivy_sandbox.client.types import ExecResult, SandboxDetail, StatusBody

__all__ = ["Client", "SyncSandbox"]

T = TypeVar("T")


def _build(http: httpx.Client, call: p.Call) -> httpx.Request:
    return http.build_request(
        call.method,
        call.path,
        headers=dict(call.headers),
        params=dict(call.params),
        json=call.json,
        timeout=httpx.USE_CLIENT_DEFAULT if call.timeout is None else call.timeout,
    )


def drive(
    steps: p.Steps[T], http: httpx.Client, sleep: Callable[[float], None]
) -> Generator[StatusBody, None, T]:
    """Perform ``steps``' effects with blocking I/O; yields what they emit, returns their
    result. Any stream still open is closed when this ends, however it ends."""
    stream: httpx.Response | None = None
    chunks: Iterator[bytes] | None = None
    answer: Any = None
    failure: BaseException | None = None

    def close_stream() -> None:
        nonlocal stream, chunks
        if stream is not None:
            stream.close()
        stream, chunks = None, None

    try:
        while True:
            try:
                effect = steps.throw(failure) if failure is not None else steps.send(answer)
            except StopIteration as done:
                result: T = done.value
                return result
            answer, failure = None, None
            try:
                if isinstance(effect, p.Emit):
                    yield effect.body
                elif isinstance(effect, p.Sleep):
                    sleep(effect.seconds)
                elif isinstance(effect, p.Call):
                    answer = http.send(_build(http, effect))
                elif isinstance(effect, p.OpenStream):
                    close_stream()
                    response = http.send(_build(http, effect.call), stream=True)
                    if p.wants_body(response):
                        try:
                            response.read()
                        finally:
                            response.close()
                    else:
                        stream, chunks = response, response.iter_bytes()
                    answer = response
                elif isinstance(effect, p.Receive):
                    assert chunks is not None, "Receive without an open stream"
                    answer = next(chunks, b"")
                elif isinstance(effect, p.CloseStream):
                    close_stream()
            except httpx.HTTPError as exc:
                failure = exc
    finally:
        close_stream()
        steps.close()


def run(steps: p.Steps[T], http: httpx.Client, sleep: Callable[[float], None]) -> T:
    """Run steps that emit nothing (plain requests) to their result."""
    driven = drive(steps, http, sleep)
    with closing(driven):
        while True:
            try:
                next(driven)
            except StopIteration as done:
                result: T = done.value
                return result


class SyncSandbox:
    """``client.sandbox``: the sandbox of a chat."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def _run(self, steps: p.Steps[T]) -> T:
        return run(steps, self._client._http, self._client._sleep)

    def status(self, chat_id: str) -> StatusBody:
        """The status body (``GET /v1/sandbox/{chatId}/status``)."""
        return self._run(p.status(chat_id))

    def get(self, chat_id: str) -> SandboxDetail:
        """The full record: status fields, ``errorCode``, phase timeline, times, queueing."""
        return self._run(p.detail(chat_id))

    def launch(self, chat_id: str) -> StatusBody:
        """Launch (idempotent while provisioning or active); returns at once with the status."""
        return self._run(p.launch(chat_id))

    def stop(self, chat_id: str) -> StatusBody:
        """Stop from any state (the workspace is kept); returns ``{"status": "none"}``."""
        return self._run(p.stop(chat_id))

    def keep_alive(self, chat_id: str) -> StatusBody:
        """Count as activity, so the sandbox is not reaped as idle."""
        return self._run(p.keep_alive(chat_id))

    def exec(
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
        return self._run(steps)

    def events(self, chat_id: str) -> Iterator[StatusBody]:
        """Status bodies from the event stream: the current one, then one per change; ends
        after ``active``, ``failed`` or ``none``. One connection, no fallback (see
        :meth:`wait_until_ready` for that)."""
        return drive(p.events(chat_id), self._client._http, self._client._sleep)

    def wait_until_ready(
        self,
        chat_id: str,
        *,
        timeout: float = 300.0,
        on_progress: Callable[[StatusBody], object] | None = None,
    ) -> StatusBody:
        """Wait until the sandbox is ``active`` and return that status body.

        Watches the event stream, else long-polls, else polls once a second; ``on_progress``
        is called with every status body that is news (a change of status, phase or error —
        the first one included; count ``etaSeconds`` down yourself between calls).

        Raises :class:`SandboxFailedError` (with ``error_code``) if it fails,
        :class:`NoSandboxError` if the chat has no sandbox, :class:`TimeoutError` after
        ``timeout`` seconds, and :class:`RateLimitError` for a 429 it cannot wait out.
        """
        steps = p.wait_until_ready(chat_id, timeout=timeout, clock=self._client._clock)
        driven = drive(steps, self._client._http, self._client._sleep)
        with closing(driven):
            while True:
                try:
                    body = next(driven)
                except StopIteration as done:
                    ready: StatusBody = done.value
                    return ready
                if on_progress is not None:
                    on_progress(body)


class Client:
    """A synchronous client of the ivy-sandbox API.

    ``base_url`` and ``api_key`` default to ``IVY_API_URL`` (else ``http://127.0.0.1:8000``) and
    ``IVY_API_KEY``. ``transport`` is any ``httpx.BaseTransport`` (tests pass one that reaches
    the app in-process); ``timeout`` is the default per-request timeout in seconds.
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        transport: httpx.BaseTransport | None = None,
        timeout: float = 30.0,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        url, key = p.resolve_config(base_url, api_key)
        self._http = httpx.Client(
            base_url=url, headers=p.default_headers(key), transport=transport, timeout=timeout
        )
        self._sleep = sleep
        self._clock = clock
        self.sandbox = SyncSandbox(self)

    @property
    def base_url(self) -> str:
        return str(self._http.base_url).rstrip("/")

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

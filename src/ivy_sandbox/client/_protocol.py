"""What the SDK does, without doing any I/O: shared by :class:`Client` and :class:`AsyncClient`.

Every operation is a generator of *effects* (send a request, open/read/close an event stream,
sleep, report a status body). A driver — a few lines of blocking code in ``sync.py``, of
``await`` in ``aio.py`` — performs each effect and sends back its result (or throws its
``httpx`` error in). So the state machine of ``wait_until_ready`` exists once, and both clients
behave identically by construction.

Waiting (``wait_until_ready``), in order of preference:

1. **Server-Sent Events** (``GET …/events``): one connection, one event per change. Each
   connection reads with a timeout of ``min(time left, 20 s)`` (the server sends a keep-alive at
   least every 15 s); a stream that drops after delivering events is reopened (after at least
   1 s, or the ``retry:`` the server asked for). Unavailable — connection error, 404, 405, 406,
   501, an answer that is not ``text/event-stream``, or a stream that ends or stalls before its
   first event — means: fall back to
2. **long-poll** on the status endpoint (``Prefer: wait=N`` with ``since=<ETag>``; a first
   ``wait=0`` request learns the ETag when no event supplied one). Unavailable — a connection
   error, or an answer without ``Preference-Applied``/``ETag`` (a server or proxy that ignores
   ``Prefer``) — means: fall back to
3. **polling** the status endpoint once a second (the seed's cadence).

Throughout: two status requests never start less than a second apart unless the first one
brought news (a change of status or phase) or found its method unavailable (then the next
method starts at once; a long-poll answered as a plain poll counts as a poll). A 429 is
waited out when its ``Retry-After`` fits in the time left (else :class:`RateLimitError`).
The timeout bounds everything, sleeps included; a read never waits past it by more than
about a second.
"""

from __future__ import annotations

import email.utils
import json
import logging
import math
import os
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeAlias, TypeVar, cast
from urllib.parse import quote

import httpx

from ivy_sandbox.client.errors import (
    APIConnectionError,
    APIStatusError,
    AuthenticationError,
    ConflictError,
    IvySandboxClientError,
    NoSandboxError,
    PermissionDeniedError,
    RateLimitError,
    SandboxFailedError,
    TimeoutError,
)
from ivy_sandbox.client.sse import ServerSentEvent, SSEDecoder
from ivy_sandbox.client.types import ExecResult, SandboxDetail, StatusBody

log = logging.getLogger("ivy_sandbox.client")

DEFAULT_URL = "http://127.0.0.1:8000"
POLL_SECONDS = 1.0  # the seed: "poll about once per second or two" — never faster
STREAM_READ_SECONDS = 20.0  # an event stream silent this long has stalled (keep-alive: 15 s)
LONG_POLL_MAX_SECONDS = 60  # the server's cap on Prefer: wait=N
LONG_POLL_GRACE_SECONDS = 10.0  # the HTTP read timeout of a long-poll is N plus this
EXEC_GRACE_SECONDS = 30.0  # the HTTP read timeout of an exec is its timeout plus this
DEFAULT_EXEC_TIMEOUT = 60.0  # the server's default timeoutSeconds
SSE_UNSUPPORTED = frozenset({404, 405, 406, 501})

T = TypeVar("T")


# -- effects ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Call:
    """Send a request; the answer is the (read) ``httpx.Response``."""

    method: str
    path: str
    headers: Mapping[str, str] = field(default_factory=dict)
    params: Mapping[str, str] = field(default_factory=dict)
    json: Any = None
    timeout: float | None = None  # seconds; None: the client's default


@dataclass(frozen=True, slots=True)
class OpenStream:
    """Send a request and keep the body open if it is a 200 event stream (any open stream is
    closed first). The answer is the ``httpx.Response``; anything else is read in full."""

    call: Call


@dataclass(frozen=True, slots=True)
class Receive:
    """The next bytes of the open stream (``b""`` at its end); a read waits at most the
    stream's ``call.timeout`` (``httpx.ReadTimeout``)."""


@dataclass(frozen=True, slots=True)
class CloseStream:
    """Close the open stream, if any."""


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


@dataclass(frozen=True, slots=True)
class Emit:
    """Report a status body to the caller (``on_progress``, or the ``events()`` iterator)."""

    body: StatusBody


Effect: TypeAlias = Call | OpenStream | Receive | CloseStream | Sleep | Emit
Steps: TypeAlias = Generator[Effect, Any, T]


def wants_body(response: httpx.Response) -> bool:
    """Whether a driver must read a streamed answer in full (it is not an event stream)."""
    return response.status_code != 200 or not is_event_stream(response)


def is_event_stream(response: httpx.Response) -> bool:
    content_type = str(response.headers.get("content-type", ""))
    return content_type.split(";")[0].strip().lower() == "text/event-stream"


# -- configuration and answers ---------------------------------------------------------------
def resolve_config(base_url: str | None, api_key: str | None) -> tuple[str, str]:
    """Arguments first, then ``IVY_API_URL`` / ``IVY_API_KEY``; the URL defaults to a local
    server. No key is an error: every endpoint needs one."""
    url = base_url or os.environ.get("IVY_API_URL") or DEFAULT_URL
    key = api_key or os.environ.get("IVY_API_KEY")
    if not key:
        raise IvySandboxClientError("no API key: pass api_key= or set IVY_API_KEY")
    return url.rstrip("/"), key


def default_headers(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}", "User-Agent": "ivy-sandbox-python"}


def sandbox_path(chat_id: str, suffix: str = "") -> str:
    return f"/v1/sandbox/{quote(chat_id, safe='')}{suffix}"


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def retry_after_seconds(value: str | None) -> float:
    """``Retry-After`` as seconds: a number, or an HTTP date; one poll interval if unusable."""
    if not value:
        return POLL_SECONDS
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return POLL_SECONDS
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - datetime.now(UTC)).total_seconds()
    return max(0.0, seconds) if math.isfinite(seconds) else POLL_SECONDS


def error_for(response: httpx.Response) -> APIStatusError | None:
    """The typed error an answer stands for, or ``None`` for a success."""
    if response.is_success:
        return None
    try:
        problem = response.json()
    except ValueError:
        problem = None
    if not isinstance(problem, dict):
        problem = {}
    code = str(problem.get("code", "http_error"))
    detail = str(problem.get("detail", response.reason_phrase))
    status = response.status_code
    if status == 401:
        return AuthenticationError(status, code, detail)
    if status == 403:
        return PermissionDeniedError(status, code, detail)
    if status == 409:
        return ConflictError(status, code, detail)
    if status == 429:
        retry_after = retry_after_seconds(response.headers.get("retry-after"))
        return RateLimitError(status, code, detail, retry_after)
    return APIStatusError(status, code, detail)


def raise_for_status(response: httpx.Response) -> None:
    error = error_for(response)
    if error is not None:
        raise error


def parse_json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError as exc:
        raise IvySandboxClientError(
            f"the server answered {response.status_code} with a body that is not JSON"
        ) from exc


def send(call: Call) -> Steps[httpx.Response]:
    try:
        response: httpx.Response = yield call
    except httpx.HTTPError as exc:
        raise APIConnectionError(f"{call.method} {call.path}: {describe(exc)}") from exc
    return response


def request_json(call: Call) -> Steps[Any]:
    response = yield from send(call)
    raise_for_status(response)
    return parse_json(response)


# -- plain operations ------------------------------------------------------------------------
def status(chat_id: str) -> Steps[StatusBody]:
    return cast(
        StatusBody, (yield from request_json(Call("GET", sandbox_path(chat_id, "/status"))))
    )


def detail(chat_id: str) -> Steps[SandboxDetail]:
    return cast(SandboxDetail, (yield from request_json(Call("GET", sandbox_path(chat_id)))))


def launch(chat_id: str) -> Steps[StatusBody]:
    return cast(StatusBody, (yield from request_json(Call("POST", sandbox_path(chat_id)))))


def stop(chat_id: str) -> Steps[StatusBody]:
    return cast(StatusBody, (yield from request_json(Call("DELETE", sandbox_path(chat_id)))))


def keep_alive(chat_id: str) -> Steps[StatusBody]:
    call = Call("POST", sandbox_path(chat_id, "/keepalive"))
    return cast(StatusBody, (yield from request_json(call)))


def exec_command(
    chat_id: str,
    command: Sequence[str],
    *,
    timeout_seconds: float | None,
    cwd: str | None,
    env: Mapping[str, str] | None,
    stdin: str | None,
) -> Steps[ExecResult]:
    if isinstance(command, str):
        raise TypeError("command must be a sequence of arguments, e.g. ['ls', '-la']")
    body: dict[str, Any] = {"command": list(command)}
    if timeout_seconds is not None:
        body["timeoutSeconds"] = timeout_seconds
    if cwd is not None:
        body["cwd"] = cwd
    if env is not None:
        body["env"] = dict(env)
    if stdin is not None:
        body["stdin"] = stdin
    http_timeout = (timeout_seconds or DEFAULT_EXEC_TIMEOUT) + EXEC_GRACE_SECONDS
    call = Call("POST", sandbox_path(chat_id, "/exec"), json=body, timeout=http_timeout)
    return cast(ExecResult, (yield from request_json(call)))


# -- Server-Sent Events ----------------------------------------------------------------------
def status_of(event: ServerSentEvent) -> StatusBody | None:
    """The status body an event carries; ``None`` for events of other types. An ``error``
    event (the stream's credential or access ended) raises the matching typed error."""
    if event.event == "error":
        try:
            code = str(json.loads(event.data).get("code", "stream_error"))
        except (ValueError, AttributeError):
            code = "stream_error"
        if code == "unauthenticated":
            raise AuthenticationError(401, code, "the credential stopped being valid")
        if code == "forbidden":
            raise PermissionDeniedError(403, code, "the chat is no longer accessible")
        raise APIStatusError(200, code, "the event stream ended with an error")
    if event.event != "status":
        return None
    try:
        body = json.loads(event.data)
    except ValueError as exc:
        raise IvySandboxClientError(f"a status event that is not JSON: {event.data!r}") from exc
    if not isinstance(body, dict) or "status" not in body:
        raise IvySandboxClientError(f"a status event without a status: {event.data!r}")
    return cast(StatusBody, body)


def events(chat_id: str) -> Steps[None]:
    """``GET …/events``: emit every status body until the server ends the stream."""
    call = Call("GET", sandbox_path(chat_id, "/events"), headers={"Accept": "text/event-stream"})
    try:
        response: httpx.Response = yield OpenStream(call)
    except httpx.HTTPError as exc:
        raise APIConnectionError(f"GET {call.path}: {describe(exc)}") from exc
    raise_for_status(response)
    if not is_event_stream(response):
        raise IvySandboxClientError(
            "the server did not answer with an event stream "
            f"({response.headers.get('content-type', 'no content type')})"
        )
    decoder = SSEDecoder()
    while True:
        try:
            chunk: bytes = yield Receive()
        except httpx.HTTPError as exc:
            raise APIConnectionError(f"the event stream broke: {describe(exc)}") from exc
        for event in decoder.feed(chunk) if chunk else decoder.close():
            body = status_of(event)
            if body is not None:
                yield Emit(body)
        if not chunk:
            yield CloseStream()
            return


# -- waiting ---------------------------------------------------------------------------------
def change_key(body: StatusBody) -> tuple[object, ...]:
    """What makes a status body news — the server's own notion of a change: status, phase,
    error, creation (a relaunch) and whether an ETA is known. Not the ETA's count-down."""
    return (
        body.get("status"),
        body.get("phase"),
        body.get("errorMessage"),
        body.get("createdAt"),
        "etaSeconds" in body,
    )


def etag_token(value: str | None) -> str | None:
    if not value:
        return None
    return value.strip().removeprefix("W/").strip('"') or None


@dataclass(frozen=True, slots=True)
class _StreamEnded:
    received: int  # status events this connection delivered
    retry_ms: int | None
    tighten: bool = False  # reopened only to read with a shorter timeout


@dataclass
class Waiter:
    """The state machine of ``wait_until_ready`` (see the module docstring)."""

    chat_id: str
    timeout: float
    clock: Callable[[], float]
    deadline: float = field(init=False)
    last_key: tuple[object, ...] | None = None
    last_body: StatusBody | None = None
    token: str | None = None  # the last state token (SSE id / ETag): long-poll's `since`
    last_request_at: float | None = None
    news: bool = False  # the last answer was a change

    def __post_init__(self) -> None:
        self.deadline = self.clock() + self.timeout

    def run(self) -> Steps[StatusBody]:
        result = yield from self.via_events()
        if result is None:
            result = yield from self.via_long_poll()
        if result is None:
            result = yield from self.via_polling()
        return result

    # ---- shared steps
    def remaining(self) -> float:
        return self.deadline - self.clock()

    def timed_out(self) -> TimeoutError:
        body = self.last_body
        seen = "nothing" if body is None else f"{body.get('status')}/{body.get('phase', '-')}"
        return TimeoutError(
            f"the sandbox of {self.chat_id} was not active after {self.timeout:g} s "
            f"(last seen: {seen})"
        )

    def sleep_or_time_out(self, seconds: float) -> Steps[None]:
        """Sleep ``seconds``; if the deadline comes first, sleep until it and time out."""
        remaining = self.remaining()
        if seconds >= remaining:
            if remaining > 0:
                yield Sleep(remaining)
            raise self.timed_out()
        if seconds > 0:
            yield Sleep(seconds)

    def pace(self, *, strict: bool = False) -> Steps[None]:
        """Keep status requests at least a second apart, unless the last one brought news
        (``strict``: even then — plain polling)."""
        if self.last_request_at is None or (self.news and not strict):
            return
        yield from self.sleep_or_time_out(self.last_request_at + POLL_SECONDS - self.clock())

    def unavailable(self) -> None:
        """This method of watching is unavailable: the next one may start at once."""
        self.last_request_at = None

    def started_request(self) -> None:
        self.last_request_at = self.clock()
        self.news = False

    def observe(self, body: StatusBody) -> Steps[StatusBody | None]:
        """Report ``body`` if it is news; the result of the wait if it is final."""
        self.last_body = body
        key = change_key(body)
        if key != self.last_key:
            self.last_key = key
            self.news = True
            yield Emit(body)
        state = body.get("status")
        if state == "active":
            return body
        if state == "failed":
            raise (yield from self.failure(body))
        if state == "none":
            raise NoSandboxError(self.chat_id)
        return None

    def failure(self, body: StatusBody) -> Steps[SandboxFailedError]:
        """The error for a failed sandbox; its ``errorCode`` is on the full record."""
        try:
            record = yield from request_json(Call("GET", sandbox_path(self.chat_id)))
        except IvySandboxClientError as exc:
            log.warning("could not read the failed sandbox's record: %s", exc)
            record = {}
        code = record.get("errorCode") if isinstance(record, dict) else None
        return SandboxFailedError(
            str(code) if code else None, str(body.get("errorMessage", "sandbox failed"))
        )

    def rate_limited(self, response: httpx.Response) -> Steps[None]:
        """Wait out a 429 if its Retry-After fits in the time left; else raise it."""
        error = error_for(response)
        assert isinstance(error, RateLimitError)
        pause = max(error.retry_after, POLL_SECONDS)
        if pause > self.remaining():
            raise error
        log.info("rate limited; retrying in %.1f s", pause)
        yield Sleep(pause)

    # ---- 1. Server-Sent Events
    def via_events(self) -> Steps[StatusBody | None]:
        path = sandbox_path(self.chat_id, "/events")
        while True:
            yield from self.pace()
            remaining = self.remaining()
            if remaining <= 0:
                raise self.timed_out()
            read_timeout = min(remaining, STREAM_READ_SECONDS)
            call = Call("GET", path, headers={"Accept": "text/event-stream"}, timeout=read_timeout)
            self.started_request()
            try:
                response: httpx.Response = yield OpenStream(call)
            except httpx.HTTPError as exc:
                if self.remaining() <= 0:
                    raise self.timed_out() from exc
                log.info("no event stream (%s); falling back to long-poll", describe(exc))
                self.unavailable()
                return None
            if response.status_code in SSE_UNSUPPORTED or (
                response.is_success and not is_event_stream(response)
            ):
                log.info("no event stream (%s); falling back to long-poll", response.status_code)
                self.unavailable()
                return None
            if response.status_code == 429:
                yield from self.rate_limited(response)
                continue
            raise_for_status(response)
            ended = yield from self.read_stream(read_timeout)
            if not isinstance(ended, _StreamEnded):
                return ended
            if ended.tighten:
                continue
            if ended.received == 0:
                log.info("the event stream delivered nothing; falling back to long-poll")
                return None
            # A stream that dropped after delivering events: reconnect, as EventSource would.
            yield from self.sleep_or_time_out(max(POLL_SECONDS, (ended.retry_ms or 0) / 1000))

    def read_stream(self, read_timeout: float) -> Steps[StatusBody | _StreamEnded]:
        decoder = SSEDecoder()
        received = 0
        while True:
            remaining = self.remaining()
            if remaining <= 0:
                raise self.timed_out()
            if remaining < read_timeout - 1.0:  # the next read could overrun the deadline
                yield CloseStream()
                return _StreamEnded(received, decoder.retry_ms, tighten=True)
            try:
                chunk: bytes = yield Receive()
            except httpx.HTTPError as exc:
                if self.remaining() <= 0:
                    raise self.timed_out() from exc
                log.info("the event stream broke: %s", describe(exc))
                yield CloseStream()
                return _StreamEnded(received, decoder.retry_ms)
            for event in decoder.feed(chunk) if chunk else decoder.close():
                body = status_of(event)
                if body is None:
                    continue
                received += 1
                self.token = event.id or self.token
                result = yield from self.observe(body)
                if result is not None:
                    yield CloseStream()
                    return result
            if not chunk:
                yield CloseStream()
                return _StreamEnded(received, decoder.retry_ms)

    # ---- 2. long-poll
    def via_long_poll(self) -> Steps[StatusBody | None]:
        path = sandbox_path(self.chat_id, "/status")
        while True:
            yield from self.pace()
            remaining = self.remaining()
            if remaining <= 0:
                raise self.timed_out()
            # Without a token, wait=0 answers at once with the current body and its ETag.
            wait = 0 if self.token is None else max(1, min(LONG_POLL_MAX_SECONDS, int(remaining)))
            params = {"since": self.token} if self.token is not None else {}
            call = Call(
                "GET",
                path,
                headers={"Prefer": f"wait={wait}"},
                params=params,
                timeout=wait + LONG_POLL_GRACE_SECONDS,
            )
            self.started_request()
            try:
                response: httpx.Response = yield call
            except httpx.HTTPError as exc:
                if self.remaining() <= 0:
                    raise self.timed_out() from exc
                log.info("long-poll failed (%s); falling back to polling", describe(exc))
                self.unavailable()
                return None
            if response.status_code == 429:
                yield from self.rate_limited(response)
                continue
            raise_for_status(response)
            body = cast(StatusBody, parse_json(response))
            token = etag_token(response.headers.get("etag"))
            result = yield from self.observe(body)
            if result is not None:
                return result
            if token is None or "preference-applied" not in response.headers:
                log.info("the server ignored Prefer: wait; falling back to polling")
                return None
            self.token = token

    # ---- 3. polling
    def via_polling(self) -> Steps[StatusBody]:
        path = sandbox_path(self.chat_id, "/status")
        while True:
            yield from self.pace(strict=True)
            self.started_request()
            response = yield from send(Call("GET", path))
            if response.status_code == 429:
                yield from self.rate_limited(response)
                continue
            raise_for_status(response)
            result = yield from self.observe(cast(StatusBody, parse_json(response)))
            if result is not None:
                return result


def wait_until_ready(
    chat_id: str, *, timeout: float, clock: Callable[[], float]
) -> Steps[StatusBody]:
    if timeout <= 0:
        raise ValueError("timeout must be positive")
    return (yield from Waiter(chat_id, timeout, clock).run())

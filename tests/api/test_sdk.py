"""The Python SDK (``ivy_sandbox.client``) against the real app, driven by a real worker over the
fake backend (a named test double with small phase delays).

Two ways in, both with the app in this process and event loop:

- ``async-asgi``: ``AsyncClient`` on ``httpx.ASGITransport`` (no sockets; note that this
  transport hands over a streamed body only once the app has finished it);
- ``sync-http`` / ``async-http``: a real uvicorn server in this event loop on a free port;
  the synchronous ``Client`` runs in a worker thread, so true streaming, real timeouts.

A recording transport wrapper sees every request the SDK makes (to check which of events,
long-poll and polling it used, and how often), and can play a server or proxy that has no
event stream (404 on ``/events``) or ignores ``Prefer: wait``.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import json
import shutil
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

import ivy_sandbox.client
from conftest import World
from fakes import WallClock
from ivy_sandbox.api.app import create_app
from ivy_sandbox.backends.fake import FakeBackend
from ivy_sandbox.bootstrap import Services
from ivy_sandbox.client import (
    APIConnectionError,
    AsyncClient,
    AuthenticationError,
    Client,
    ConflictError,
    NoSandboxError,
    PermissionDeniedError,
    RateLimitError,
    SandboxFailedError,
)
from ivy_sandbox.client import TimeoutError as SdkTimeoutError
from ivy_sandbox.client import _protocol as protocol
from ivy_sandbox.client.sse import ServerSentEvent, SSEDecoder
from ivy_sandbox.domain.sandbox import Phase
from ivy_sandbox.ratelimit import RateLimiter, make_storage

DELAY = 0.2  # seconds per phase of the fake backend
ALL_PHASES = [
    ("provisioning", "compute"),
    ("provisioning", "mount"),
    ("provisioning", "ready"),
    ("active", "ready"),
]
README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture
def database_url(tmp_path: Path, sqlite_template: Path) -> str:
    """SQLite only: this module tests the client, and the server's behaviour on PostgreSQL
    is covered by the other API tests (test_watch.py for events and long-poll)."""
    target = tmp_path / "ivy.db"
    shutil.copy(sqlite_template, target)
    return f"sqlite+aiosqlite:///{target}"


@pytest.fixture
def clock() -> WallClock:  # type: ignore[override]
    return WallClock()


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend(delays={Phase.COMPUTE: DELAY, Phase.MOUNT: DELAY, Phase.READY: DELAY})


# -- the way in ------------------------------------------------------------------------------
@dataclass
class Seen:
    at: float
    method: str
    path: str
    prefer: str | None
    since: str | None
    status: int = 0
    retry_after: str | None = None


@dataclass
class Recorder:
    """What the SDK sent; optionally plays a server without events or without long-poll."""

    refuse_events: bool = False
    ignore_prefer: bool = False
    seen: list[Seen] = field(default_factory=list)

    def before(self, request: httpx.Request) -> tuple[Seen, httpx.Response | None]:
        seen = Seen(
            time.monotonic(),
            request.method,
            request.url.path,
            request.headers.get("prefer"),
            request.url.params.get("since"),
        )
        self.seen.append(seen)
        if self.refuse_events and request.url.path.endswith("/events"):
            seen.status = 404
            return seen, httpx.Response(404, json={"code": "not_found", "detail": "Not Found"})
        if self.ignore_prefer and "prefer" in request.headers:
            del request.headers["prefer"]
        return seen, None

    def kinds(self) -> list[str]:
        """Each request as events / long-poll / poll / other."""
        kinds = []
        for seen in self.seen:
            if seen.path.endswith("/events"):
                kinds.append("events")
            elif seen.path.endswith("/status"):
                kinds.append("long-poll" if seen.prefer else "poll")
            else:
                kinds.append(f"{seen.method} {seen.path.rsplit('/', 1)[-1]}")
        return kinds


class AsyncRecording(httpx.AsyncBaseTransport):
    def __init__(self, inner: httpx.AsyncBaseTransport, recorder: Recorder) -> None:
        self.inner, self.recorder = inner, recorder

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        seen, early = self.recorder.before(request)
        if early is not None:
            return early
        response = await self.inner.handle_async_request(request)
        seen.status, seen.retry_after = response.status_code, response.headers.get("retry-after")
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


class SyncRecording(httpx.BaseTransport):
    def __init__(self, inner: httpx.BaseTransport, recorder: Recorder) -> None:
        self.inner, self.recorder = inner, recorder

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        seen, early = self.recorder.before(request)
        if early is not None:
            return early
        response = self.inner.handle_request(request)
        seen.status, seen.retry_after = response.status_code, response.headers.get("retry-after")
        return response

    def close(self) -> None:
        self.inner.close()


class _InLoopServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # leave the test runner's signals alone
        yield


@pytest.fixture
async def live_url(services: Services) -> AsyncIterator[str]:
    """The app behind a real uvicorn server, in this event loop, on a free port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = create_app(services.settings, services=services)
    config = uvicorn.Config(
        app, lifespan="off", log_level="warning", http="h11", timeout_graceful_shutdown=1
    )
    server = _InLoopServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    await asyncio.wait_for(task, 10)
    sock.close()


class Sdk:
    """One client of the kind under test, with the same awaitable face for both kinds."""

    def __init__(self, client: Client | AsyncClient, recorder: Recorder) -> None:
        self.client, self.recorder = client, recorder

    @property
    def is_async(self) -> bool:
        return isinstance(self.client, AsyncClient)

    async def __call__(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self.client, AsyncClient):
            return await getattr(self.client.sandbox, method)(*args, **kwargs)
        call = functools.partial(getattr(self.client.sandbox, method), *args, **kwargs)
        return await asyncio.to_thread(call)

    async def events(self, chat: str) -> list[dict[str, Any]]:
        if isinstance(self.client, AsyncClient):
            return [dict(body) async for body in self.client.sandbox.events(chat)]
        sync = self.client
        return await asyncio.to_thread(lambda: [dict(b) for b in sync.sandbox.events(chat)])

    async def close(self) -> None:
        if isinstance(self.client, AsyncClient):
            await self.client.aclose()
        else:
            self.client.close()


SdkFactory = Callable[..., Sdk]


async def _factory(kind: str, services: Services, url: str) -> AsyncIterator[SdkFactory]:
    made: list[Sdk] = []

    def make(key: str, *, refuse_events: bool = False, ignore_prefer: bool = False) -> Sdk:
        recorder = Recorder(refuse_events=refuse_events, ignore_prefer=ignore_prefer)
        client: Client | AsyncClient
        if kind == "async-asgi":
            app = create_app(services.settings, services=services)
            inner = httpx.ASGITransport(app=app, client=("203.0.113.7", 40000))
            transport = AsyncRecording(inner, recorder)
            client = AsyncClient("http://ivy.test", key, transport=transport)
        elif kind == "async-http":
            transport = AsyncRecording(httpx.AsyncHTTPTransport(), recorder)
            client = AsyncClient(url, key, transport=transport)
        else:
            client = Client(url, key, transport=SyncRecording(httpx.HTTPTransport(), recorder))
        sdk = Sdk(client, recorder)
        made.append(sdk)
        return sdk

    yield make
    for sdk in made:
        await sdk.close()


@pytest.fixture(params=["async-asgi", "sync-http"])
async def make_sdk(
    request: pytest.FixtureRequest, services: Services, live_url: str, worker: Any
) -> AsyncIterator[SdkFactory]:
    """Parametrized over the asynchronous client (ASGI) and the synchronous one (real HTTP)."""
    async for factory in _factory(request.param, services, live_url):
        yield factory


@pytest.fixture(params=["async-http", "sync-http"])
async def make_streaming_sdk(
    request: pytest.FixtureRequest, services: Services, live_url: str, worker: Any
) -> AsyncIterator[SdkFactory]:
    """Both clients over real HTTP, where a stream arrives as it is written."""
    async for factory in _factory(request.param, services, live_url):
        yield factory


@dataclass
class Account:
    chat: str
    key: str


@pytest.fixture
async def account(world: World) -> Account:
    return Account(await world.chat(), await world.key())


class Progress:
    """An on_progress callback that remembers what it saw, and when."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.times: list[float] = []

    def __call__(self, body: Any) -> None:
        self.bodies.append(dict(body))
        self.times.append(time.monotonic())

    @property
    def phases(self) -> list[tuple[str, str | None]]:
        return [(b["status"], b.get("phase")) for b in self.bodies]


# -- the public surface ----------------------------------------------------------------------
DOCUMENTED_NAMES = {
    "APIConnectionError",
    "APIStatusError",
    "AsyncClient",
    "AuthenticationError",
    "Client",
    "ConflictError",
    "ExecResult",
    "IvySandboxClientError",
    "NoSandboxError",
    "PermissionDeniedError",
    "RateLimitError",
    "SandboxDetail",
    "SandboxFailedError",
    "StatusBody",
    "TimeoutError",
}


def test_the_public_names_are_exactly_the_documented_ones_and_all_importable() -> None:
    assert sorted(ivy_sandbox.client.__all__) == sorted(DOCUMENTED_NAMES)
    assert len(ivy_sandbox.client.__all__) == len(set(ivy_sandbox.client.__all__))
    namespace: dict[str, Any] = {}
    exec(f"from ivy_sandbox.client import {', '.join(DOCUMENTED_NAMES)}", namespace)  # noqa: S102
    assert all(namespace[name] is getattr(ivy_sandbox.client, name) for name in DOCUMENTED_NAMES)
    # The README's "Use it from Python" section lists them.
    section = README.read_text().split("## Use it from Python", 1)[1].split("\n## ", 1)[0]
    assert all(f"`{name}`" in section for name in DOCUMENTED_NAMES)


def test_the_package_is_marked_typed() -> None:
    assert (Path(ivy_sandbox.client.__file__).parents[1] / "py.typed").exists()


def test_the_sdk_timeout_error_is_also_the_builtin_one() -> None:
    assert issubclass(SdkTimeoutError, builtins.TimeoutError)
    assert issubclass(SdkTimeoutError, ivy_sandbox.client.IvySandboxClientError)


def test_configuration_comes_from_arguments_else_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("IVY_API_URL", "http://env.example:9/")
    monkeypatch.setenv("IVY_API_KEY", "ivy_env")
    with Client() as from_env:
        assert from_env.base_url == "http://env.example:9"
        assert from_env._http.headers["authorization"] == "Bearer ivy_env"
    with Client("http://arg.example", "ivy_arg") as from_args:
        assert from_args.base_url == "http://arg.example"
        assert from_args._http.headers["authorization"] == "Bearer ivy_arg"
    monkeypatch.delenv("IVY_API_KEY")
    with pytest.raises(ivy_sandbox.client.IvySandboxClientError, match="IVY_API_KEY"):
        AsyncClient()


# -- the SSE decoder (sans-IO) ---------------------------------------------------------------
def decode(*chunks: bytes) -> tuple[list[ServerSentEvent], SSEDecoder]:
    decoder = SSEDecoder()
    events = [event for chunk in chunks for event in decoder.feed(chunk)]
    return events + decoder.close(), decoder


def test_sse_decoder_joins_multi_line_data_and_skips_comments() -> None:
    events, _ = decode(b': keep-alive\n\nevent: status\ndata: {"a":\ndata: 1}\n\n')
    assert events == [ServerSentEvent("status", '{"a":\n1}', "")]


def test_sse_decoder_handles_any_chunking_and_every_line_ending() -> None:
    stream = b"id: 7\r\nevent: status\rdata: x\r\n\r\ndata: y\n\n"
    expected = [ServerSentEvent("status", "x", "7"), ServerSentEvent("message", "y", "7")]
    for size in range(1, len(stream) + 1):
        chunks = [stream[i : i + size] for i in range(0, len(stream), size)]
        assert decode(*chunks)[0] == expected, size
    assert decode(*[bytes([b]) for b in "data: é\n\n".encode()])[0][0].data == "é"


def test_sse_decoder_reads_retry_and_id_and_drops_an_unterminated_event() -> None:
    events, decoder = decode(b"retry: 2000\n\nretry: soon\nid: a\x00b\ndata: 1\n\ndata: cut")
    assert decoder.retry_ms == 2000
    assert events == [ServerSentEvent("message", "1", "")]  # id with NUL ignored; "cut" dropped


def test_sse_decoder_ignores_events_without_data_and_unknown_fields() -> None:
    events, _ = decode(b"\xef\xbb\xbfevent: status\n\nfoo: bar\ndata\n\n")
    assert events == [ServerSentEvent("message", "", "")]  # the type is reset by the blank line


# -- the state machine alone (a scripted server and a fake clock) ----------------------------
class Script:
    """Runs ``wait_until_ready``'s steps against canned answers on a fake clock."""

    def __init__(
        self, answers: list[httpx.Response | Exception | bytes], receive_seconds: float = 0.0
    ) -> None:
        self.answers = answers
        self.receive_seconds = receive_seconds  # how long each read of a stream takes
        self.now = 0.0
        self.requests: list[tuple[float, protocol.Call, bool]] = []  # (when, what, streamed)
        self.sleeps: list[float] = []

    def run(self, timeout: float) -> tuple[dict[str, Any] | BaseException, list[Any]]:
        steps = protocol.wait_until_ready("chat_x", timeout=timeout, clock=lambda: self.now)
        emitted: list[Any] = []
        answer: Any = None
        failure: BaseException | None = None
        while True:
            try:
                effect = steps.throw(failure) if failure else steps.send(answer)
            except StopIteration as done:
                return done.value, emitted
            except Exception as exc:
                return exc, emitted
            answer, failure = None, None
            if isinstance(effect, protocol.Sleep):
                self.sleeps.append(effect.seconds)
                self.now += effect.seconds
            elif isinstance(effect, protocol.Emit):
                emitted.append(effect.body)
            elif isinstance(effect, protocol.Call | protocol.OpenStream):
                streamed = isinstance(effect, protocol.OpenStream)
                call = effect.call if isinstance(effect, protocol.OpenStream) else effect
                self.requests.append((self.now, call, streamed))
                reply = self.answers.pop(0)
                if isinstance(reply, Exception):
                    failure = reply
                else:
                    answer = reply
            elif isinstance(effect, protocol.Receive):
                self.now += self.receive_seconds
                reply = self.answers.pop(0)
                assert not isinstance(reply, httpx.Response)
                if isinstance(reply, bytes):
                    answer = reply
                else:
                    failure = reply


def body_response(body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.Response(200, json=body, headers=headers)


def test_state_machine_waits_out_retry_after_then_retries() -> None:
    limited = httpx.Response(429, headers={"Retry-After": "3"}, json={"code": "rate_limited"})
    stream = httpx.Response(200, headers={"content-type": "text/event-stream"})
    event = b'id: t1\nevent: status\ndata: {"status":"active","phase":"ready"}\n\n'
    script = Script([limited, stream, event])
    result, emitted = script.run(timeout=10)
    assert result == {"status": "active", "phase": "ready"} == emitted[0]
    assert script.sleeps == [3]
    assert [at for at, *_ in script.requests] == [0, 3]


def test_state_machine_raises_rate_limit_error_when_retry_after_exceeds_the_time_left() -> None:
    limited = httpx.Response(429, headers={"Retry-After": "30"}, json={"code": "rate_limited"})
    result, _ = Script([limited]).run(timeout=10)
    assert isinstance(result, RateLimitError)
    assert result.retry_after == 30


def test_state_machine_never_polls_faster_than_once_a_second() -> None:
    provisioning = {"status": "provisioning", "phase": "compute"}
    answers: list[httpx.Response | Exception | bytes] = [httpx.ConnectError("refused")] * 2
    answers += [body_response(provisioning) for _ in range(20)]
    script = Script(answers)
    result, emitted = script.run(timeout=10)
    assert isinstance(result, SdkTimeoutError)
    assert [at for at, *_ in script.requests[:3]] == [0, 0, 0]  # unavailable: next method at once
    starts = [at for at, *_ in script.requests[2:]]  # the polls
    assert len(starts) == 10
    assert all(b - a >= 1.0 for a, b in pairwise(starts))
    assert script.now == pytest.approx(10)  # it waited exactly as long as asked
    assert emitted == [provisioning]  # the same state is reported once


SSE_STREAM = httpx.Response(200, headers={"content-type": "text/event-stream"})


def sse_status(body: dict[str, Any], token: str) -> bytes:
    return f"id: {token}\nevent: status\ndata: {json.dumps(body)}\n\n".encode()


def test_state_machine_reopens_a_stream_that_drops_after_events_after_its_retry_delay() -> None:
    compute = {"status": "provisioning", "phase": "compute"}
    active = {"status": "active", "phase": "ready"}
    answers: list[httpx.Response | Exception | bytes] = [
        SSE_STREAM,
        b"retry: 2000\n\n" + sse_status(compute, "t1"),
        b"",  # the connection ends without a final state
        SSE_STREAM,
        sse_status(compute, "t1") + sse_status(active, "t2"),
    ]
    script = Script(answers)
    result, emitted = script.run(timeout=30)
    assert result == active
    assert emitted == [compute, active]  # the repeated first event of the new stream is no news
    assert script.sleeps == [2.0]
    assert [(at, streamed) for at, _, streamed in script.requests] == [(0, True), (2, True)]


def test_state_machine_falls_back_to_long_poll_when_a_stream_ends_before_its_first_event() -> None:
    script = Script([SSE_STREAM, b": hello\n\n", b"", body_response({"status": "none"})])
    result, _ = script.run(timeout=30)
    assert isinstance(result, NoSandboxError)
    assert [streamed for _, _, streamed in script.requests] == [True, False]
    assert script.requests[1][1].headers == {"Prefer": "wait=0"}  # the long-poll's first step


def test_state_machine_reads_a_stream_no_longer_than_the_time_left() -> None:
    keep_alive = b": keep-alive\n\n"
    compute = sse_status({"status": "provisioning", "phase": "compute"}, "t1")
    answers: list[httpx.Response | Exception | bytes] = [SSE_STREAM, compute, keep_alive]
    answers += [keep_alive, SSE_STREAM, keep_alive, SSE_STREAM, keep_alive, SSE_STREAM, keep_alive]
    script = Script(answers, receive_seconds=5)  # a chunk every 5 s, never a final state
    result, _ = script.run(timeout=30)
    assert isinstance(result, SdkTimeoutError)
    streams = [(at, call.timeout) for at, call, streamed in script.requests if streamed]
    # A 20 s read timeout at first; once less than that is left, a read could overrun the
    # deadline, so the stream is reopened with the time left as its read timeout.
    assert streams == [(0, 20), (15, 15), (20, 10), (25, 5)]
    assert script.now == 30
    assert answers == []


# -- errors from the real app ----------------------------------------------------------------
async def test_a_bad_key_raises_authentication_error(
    make_sdk: SdkFactory, account: Account
) -> None:
    sdk = make_sdk("ivy_not_a_real_key")
    with pytest.raises(AuthenticationError) as raised:
        await sdk("status", account.chat)
    assert raised.value.status_code == 401
    with pytest.raises(AuthenticationError):
        await sdk("wait_until_ready", account.chat, timeout=5)


async def test_another_users_chat_raises_permission_denied(
    make_sdk: SdkFactory, account: Account, world: World
) -> None:
    bob = make_sdk(await world.key("user_bob"))
    with pytest.raises(PermissionDeniedError) as raised:
        await bob("launch", account.chat)
    assert (raised.value.status_code, raised.value.code) == (403, "forbidden")
    with pytest.raises(PermissionDeniedError):
        await bob("wait_until_ready", account.chat, timeout=5)
    with pytest.raises(PermissionDeniedError):
        await bob.events(account.chat)


async def test_exec_before_the_sandbox_is_active_raises_conflict(
    make_sdk: SdkFactory, account: Account
) -> None:
    with pytest.raises(ConflictError) as raised:
        await make_sdk(account.key)("exec", account.chat, ["true"])
    assert raised.value.status_code == 409


async def test_a_failed_launch_raises_sandbox_failed_with_the_error_code(
    make_sdk: SdkFactory, account: Account, backend: FakeBackend
) -> None:
    backend.fail_in = Phase.MOUNT
    sdk = make_sdk(account.key)
    await sdk("launch", account.chat)
    progress = Progress()
    with pytest.raises(SandboxFailedError) as raised:
        await sdk("wait_until_ready", account.chat, timeout=10, on_progress=progress)
    assert raised.value.error_code == "mount_failed"
    assert raised.value.error_message.startswith("mount: ")
    assert progress.phases[-1] == ("failed", "failed")


async def test_a_launch_that_never_gets_ready_raises_timeout_error_on_time(
    make_sdk: SdkFactory, account: Account, backend: FakeBackend
) -> None:
    backend.hang_in = Phase.MOUNT  # its watchdog (5 s) is far beyond the wait
    sdk = make_sdk(account.key)
    await sdk("launch", account.chat)
    started = time.monotonic()
    with pytest.raises(SdkTimeoutError, match="not active after 1 s") as raised:
        await sdk("wait_until_ready", account.chat, timeout=1.0)
    assert isinstance(raised.value, builtins.TimeoutError)
    assert 1.0 <= time.monotonic() - started < 2.5


async def test_a_launch_that_never_gets_ready_times_out_on_the_polling_path_too(
    make_sdk: SdkFactory, account: Account, backend: FakeBackend
) -> None:
    backend.hang_in = Phase.MOUNT
    sdk = make_sdk(account.key, refuse_events=True, ignore_prefer=True)
    await sdk("launch", account.chat)
    started = time.monotonic()
    with pytest.raises(SdkTimeoutError):
        await sdk("wait_until_ready", account.chat, timeout=1.5)
    assert 1.5 <= time.monotonic() - started < 2.5
    assert set(sdk.recorder.kinds()[1:]) == {"events", "long-poll", "poll"}


async def test_waiting_on_a_chat_without_sandbox_raises_no_sandbox(
    make_sdk: SdkFactory, account: Account
) -> None:
    with pytest.raises(NoSandboxError, match=account.chat):
        await make_sdk(account.key)("wait_until_ready", account.chat, timeout=5)


def test_an_unreachable_server_raises_api_connection_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # bound, never listening

        async def status() -> None:
            async with AsyncClient(url, "ivy_key") as ivy:
                await ivy.sandbox.status("chat_x")

        with pytest.raises(APIConnectionError):
            asyncio.run(status())
        with Client(url, "ivy_key") as sync_ivy, pytest.raises(APIConnectionError):
            sync_ivy.sandbox.wait_until_ready("chat_x", timeout=10)


async def statuses_until_limited(sdk: Any, chat: str) -> None:
    """Status calls until one is limited (at most 4). Two hits spend a 2-per-window budget,
    but a sliding-window counter floors the weighted count (as limits does), so when a
    window boundary falls between the hits it allows one more."""
    for _ in range(4):
        await sdk("status", chat)


async def test_a_429_is_waited_out_per_retry_after_and_raised_when_it_cannot_be(
    make_sdk: SdkFactory, account: Account, services: Services
) -> None:
    services.limiter = RateLimiter(
        make_storage(None),
        per_user="1000/minute",
        per_chat="2/2 seconds",
        auth_failures="1000/minute",
    )
    sdk = make_sdk(account.key)
    await sdk("launch", account.chat)
    with pytest.raises(RateLimitError) as raised:
        await statuses_until_limited(sdk, account.chat)
    assert raised.value.retry_after >= 1
    with pytest.raises(RateLimitError):  # cannot wait: Retry-After is beyond the timeout
        await sdk("wait_until_ready", account.chat, timeout=0.5)
    progress = Progress()
    body = await sdk("wait_until_ready", account.chat, timeout=15, on_progress=progress)
    assert body["status"] == "active"
    seen = sdk.recorder.seen
    last_429 = max(i for i, s in enumerate(seen) if s.status == 429)
    assert last_429 > 3  # the successful wait met a 429 too, and went on
    retry_after = float(seen[last_429].retry_after or "nan")
    assert seen[last_429 + 1].at - seen[last_429].at >= retry_after - 0.05


# -- events and waiting ----------------------------------------------------------------------
async def test_events_yields_each_change_in_order_and_ends_at_active(
    make_sdk: SdkFactory, account: Account
) -> None:
    sdk = make_sdk(account.key)
    await sdk("launch", account.chat)
    bodies = await sdk.events(account.chat)
    assert [(b["status"], b.get("phase")) for b in bodies] == ALL_PHASES
    assert all(set(b) <= {"status", "phase", "etaSeconds", "createdAt"} for b in bodies)
    assert len({json.dumps(b, sort_keys=True) for b in bodies}) == len(bodies)


async def test_events_of_a_chat_without_sandbox_is_one_none(
    make_sdk: SdkFactory, account: Account
) -> None:
    assert await make_sdk(account.key).events(account.chat) == [{"status": "none"}]


async def test_wait_until_ready_over_events_reports_each_phase_once(
    make_sdk: SdkFactory, account: Account
) -> None:
    sdk = make_sdk(account.key)
    await sdk("launch", account.chat)
    progress = Progress()
    body = await sdk("wait_until_ready", account.chat, timeout=10, on_progress=progress)
    assert body["status"] == "active"
    assert progress.phases == ALL_PHASES
    assert sdk.recorder.kinds() == ["POST " + account.chat, "events"]  # one stream, no polls


async def test_wait_until_ready_falls_back_to_long_poll_without_events(
    make_sdk: SdkFactory, account: Account
) -> None:
    sdk = make_sdk(account.key, refuse_events=True)
    await sdk("launch", account.chat)
    progress = Progress()
    body = await sdk("wait_until_ready", account.chat, timeout=10, on_progress=progress)
    assert body["status"] == "active"
    assert progress.phases == ALL_PHASES
    kinds = sdk.recorder.kinds()
    assert kinds[:3] == ["POST " + account.chat, "events", "long-poll"]
    assert set(kinds[3:]) == {"long-poll"}
    long_polls = [s for s in sdk.recorder.seen if s.prefer]
    assert long_polls[0].prefer == "wait=0"  # learns the current state and its ETag
    assert all(s.since for s in long_polls[1:])  # then waits for a change from it
    assert len(long_polls) <= len(ALL_PHASES) + 1  # one answer per change, no busy loop


async def test_wait_until_ready_falls_back_to_polling_once_a_second(
    make_sdk: SdkFactory, account: Account
) -> None:
    sdk = make_sdk(account.key, refuse_events=True, ignore_prefer=True)
    await sdk("launch", account.chat)
    progress = Progress()
    body = await sdk("wait_until_ready", account.chat, timeout=15, on_progress=progress)
    assert body["status"] == "active"
    # A poll a second sees some of the phases: those it saw, once each and in order.
    assert progress.phases[-1] == ("active", "ready")
    assert progress.phases == [p for p in ALL_PHASES if p in progress.phases]
    assert [k for k in sdk.recorder.kinds()[1:] if k != "poll"] == ["events", "long-poll"]
    # The refused event stream hands over at once; from the long-poll (answered as a plain
    # poll by a server that ignores Prefer) on, status requests start a second apart or more.
    starts = [s.at for s in sdk.recorder.seen[2:]]
    assert len(starts) >= 2
    assert all(later - earlier >= 0.99 for earlier, later in pairwise(starts))


async def test_on_progress_is_called_as_changes_happen_not_at_the_end(
    make_streaming_sdk: SdkFactory, account: Account
) -> None:
    sdk = make_streaming_sdk(account.key)
    await sdk("launch", account.chat)
    progress = Progress()
    await sdk("wait_until_ready", account.chat, timeout=10, on_progress=progress)
    assert progress.phases == ALL_PHASES
    gaps = [b - a for a, b in pairwise(progress.times)]
    assert all(gap >= DELAY / 2 for gap in gaps), gaps  # each arrived when its phase began


async def test_async_on_progress_may_be_a_coroutine_function(
    services: Services, account: Account, worker: Any
) -> None:
    app = create_app(services.settings, services=services)
    seen: list[str] = []

    async def on_progress(body: Any) -> None:
        await asyncio.sleep(0)
        seen.append(body["status"])

    async with AsyncClient(
        "http://ivy.test", account.key, transport=httpx.ASGITransport(app=app)
    ) as ivy:
        await ivy.sandbox.launch(account.chat)
        await ivy.sandbox.wait_until_ready(account.chat, timeout=10, on_progress=on_progress)
    assert seen[-1] == "active"


async def test_launch_get_exec_keep_alive_and_stop_round_trip(
    make_sdk: SdkFactory, account: Account
) -> None:
    sdk = make_sdk(account.key)
    launched = await sdk("launch", account.chat)
    assert (launched["status"], launched["phase"]) == ("provisioning", "compute")
    await sdk("wait_until_ready", account.chat, timeout=10)
    record = await sdk("get", account.chat)
    assert record["status"] == "active"
    assert [p["phase"] for p in record["phases"]] == ["compute", "mount", "ready"]
    result = await sdk("exec", account.chat, ["echo", "hi"], timeout_seconds=5)
    assert (result["exitCode"], result["stdout"]) == (0, "echo hi")  # the fake echoes the argv
    assert (await sdk("keep_alive", account.chat))["status"] == "active"
    assert await sdk("stop", account.chat) == {"status": "none"}
    assert await sdk("status", account.chat) == {"status": "none"}

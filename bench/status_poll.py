"""Status poll throughput: our real `serve` against a FastAPI constant and a bare ASGI app.

Method. Every server runs on the same stack with the same flags — ours is
``ivy-sandbox serve``; the baselines go through ``bench/apps/run.py``, which calls serve's own
code with only the app swapped — one process each, pinned with ``taskset -c 0``; wrk runs
``-t1`` pinned to CPU 1, so server and load generator never share a core. Ours is the full
path: API-key (or session-token) authentication, the chat/scope check, the per-user and
per-chat rate limits (on, set far above what wrk can reach), and the status read from the
database (SQLite, the default). The polled chat has an active sandbox, so the body is the
full ``{"status":"active","phase":"ready","createdAt":…}``; the baselines answer the same
shape. The backend is ``latency-fake`` (the status endpoint never touches the backend).

Credentials measured on ours: an API key (``Authorization: Bearer ivy_…``), an RS256
Clerk session token (``Authorization: Bearer <jwt>``, the key in ``IVY_CLERK_JWT_KEY``, its
user created by its first request, its chat by the admin CLI), and the same token as the
``__session`` cookie.

Concurrency 8 and 64. Each (target, concurrency) runs ``rounds`` times, interleaved with the
other targets so slow drift of this noisy machine hits all of them alike; the figures are
medians over the rounds. Headline rps and the latency keys are at c=64. Every wrk run must see
only 2xx responses and no socket errors, or the benchmark fails: a benchmark of 401s or 429s
measures nothing.

Keys: ours_rps, fastapi_constant_rps, bare_asgi_rps, ratio_vs_fastapi, ratio_vs_bare_asgi,
p50_ms, p99_ms (ours, API key, c=64), jwt_rps, ratio_jwt_vs_key, cookie_rps; detail per
concurrency and every wrk run under ``by_concurrency`` and ``runs``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c

NAME = "status_poll"
KEYS = [
    "ours_rps",
    "fastapi_constant_rps",
    "bare_asgi_rps",
    "ratio_vs_fastapi",
    "ratio_vs_bare_asgi",
    "p50_ms",
    "p99_ms",
    "jwt_rps",
    "ratio_jwt_vs_key",
    "cookie_rps",
]
CONCURRENCY = (8, 64)
SERVER_CPU = "0"
WRK_CPU = "1"


def baseline(scratch: Path, name: str, module: str, *, plain: bool = False) -> c.Server:
    argv = [
        *c.taskset_prefix(SERVER_CPU),
        sys.executable,
        str(c.BENCH_DIR / "apps" / "run.py"),
        module,
        "--host",
        c.HOST,
        "--port",
        "{port}",
    ]
    if plain:
        argv.append("--plain-uvicorn")
    env = c.clean_env({"IVY_DATA_DIR": str((scratch / name / "data").resolve())})
    ready = "/openapi.json" if module == "fastapi_constant" else "/"
    return c.Server(name=name, argv=argv, env=env, log_dir=scratch / name, ready_path=ready)


def status_gaps(top: dict[str, Any]) -> dict[str, Any]:
    """By how much and why each missed goal (at c=64) was missed, from this run's numbers."""
    ours, bare = top["ours_key"], top["bare_asgi"]
    fastapi = top["fastapi_constant"]
    per_request = (
        f"one poll costs the one server core {1e6 / ours['rps']:.0f} us against "
        f"{1e6 / bare['rps']:.0f} us for bare ASGI and {1e6 / fastapi['rps']:.0f} us for the "
        "FastAPI constant; the difference is authentication, the limits, the SQLite read and "
        "the metrics (docs/performance.md)"
    )
    checks = {
        "ratio_vs_fastapi >= 1.0": (top["ratio_vs_fastapi"], 1.0, per_request),
        "ratio_vs_bare_asgi >= 0.35": (top["ratio_vs_bare_asgi"], 0.35, per_request),
        "ratio_jwt_vs_key >= 0.9": (
            top["ratio_jwt_vs_key"],
            0.9,
            "a session token's request is ~2x an API key's in size and its cache key is a "
            "SHA-256 of the token; run to run the ratio moves by about 0.05",
        ),
        "ratio_cookie_vs_key >= 0.9": (
            top["ratio_cookie_vs_key"],
            0.9,
            "the cookie header is parsed (memoised per header) before the token's checks",
        ),
        "p99_ms <= 15": (
            ours["p99_ms"],
            15,
            f"64 requests queue on one event loop (p50 {ours['p50_ms']} ms); in the same run "
            f"bare ASGI had p99 {bare['p99_ms']} ms and the FastAPI constant "
            f"{fastapi['p99_ms']} ms: the rest is this machine's jitter",
        ),
    }
    gaps: dict[str, Any] = {}
    for goal, (measured, target, why) in checks.items():
        met = measured <= target if goal.startswith("p99") else measured >= target
        if not met:
            gaps[goal] = {"measured": measured, "short_by": round(abs(measured - target), 3)}
            gaps[goal]["why"] = why
    return gaps


def wait_active(server: c.IvyServer, chat: str, headers: dict[str, str]) -> None:
    response = httpx.post(server.url(f"/v1/sandbox/{chat}"), headers=headers, timeout=10)
    if response.status_code != 202:
        raise c.BenchError(f"launch answered {response.status_code}: {response.text}")
    server.chats_with_sandboxes[chat] = headers
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        body = c.check_200(server.url(f"/v1/sandbox/{chat}/status"), headers)
        if body["status"] == "active":
            return
        if body["status"] == "failed":
            raise c.BenchError(f"the polled chat's sandbox failed: {body}")
        time.sleep(0.2)
    raise c.BenchError("the polled chat's sandbox did not become active within 30 s")


def run(args: Any, scratch: Path) -> None:
    c.require_wrk()
    quick = args.quick
    duration = 2.0 if quick else 4.0
    rounds = 1 if quick else 3
    keys = c.SessionKeys.generate()

    ours = c.IvyServer.create(
        scratch,
        "ivy",
        env={"IVY_SANDBOX_BACKEND": "latency-fake", "IVY_CLERK_JWT_KEY": keys.public_pem},
        cpu=SERVER_CPU,
    )
    ours.start()
    chat, key = ours.account("user_bench_key")
    key_headers = {"Authorization": f"Bearer {key}"}
    wait_active(ours, chat, key_headers)

    jwt_user = "user_bench_jwt"
    token = keys.token(jwt_user)
    first = httpx.get(
        ours.url(f"/v1/sandbox/{chat}/status"),
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
    )
    if first.status_code != 403:  # the token is valid (user created) but the chat is not its
        raise c.BenchError(f"first session-token request: {first.status_code} {first.text}")
    jwt_chat = ours.admin("chats", "create", "--user", jwt_user)
    jwt_headers = {"Authorization": f"Bearer {token}"}
    wait_active(ours, jwt_chat, jwt_headers)
    cookie_headers = {"Cookie": f"__session={token}"}

    servers = {
        "bare_asgi": baseline(scratch, "bare_asgi", "bare_asgi"),
        "fastapi_constant": baseline(scratch, "fastapi_constant", "fastapi_constant"),
    }
    if not quick:
        servers["fastapi_constant_no_access_log"] = baseline(
            scratch, "fastapi_plain", "fastapi_constant", plain=True
        )
    for server in servers.values():
        server.start()

    status_path = "/v1/sandbox/{chat}/status"
    targets: dict[str, tuple[str, dict[str, str]]] = {
        "ours_key": (ours.url(status_path.format(chat=chat)), key_headers),
        "ours_jwt": (ours.url(status_path.format(chat=jwt_chat)), jwt_headers),
        "ours_cookie": (ours.url(status_path.format(chat=jwt_chat)), cookie_headers),
    }
    for name, server in servers.items():
        targets[name] = (server.url(status_path.format(chat=chat)), {})

    # Each target must answer 200 with the status body, and be the app we think it is.
    for name, (url, headers) in targets.items():
        body = c.check_200(url, headers)
        if body.get("status") != "active":
            raise c.BenchError(f"{name}: unexpected body {body}")
    marker = httpx.get(targets["bare_asgi"][0], timeout=5).headers.get("x-bench-app")
    if marker != "bare-asgi":
        raise c.BenchError("the bare ASGI baseline is not the app answering on its port")
    for name in servers:
        if name.startswith("fastapi"):
            title = httpx.get(servers[name].url("/openapi.json"), timeout=5).json()["info"]
            if title["title"] != "FastAPI":
                raise c.BenchError(f"{name}: not the FastAPI baseline answering")

    print(f"warming up {len(targets)} targets ...", flush=True)
    for name, (url, headers) in targets.items():
        c.wrk(url, label=name, connections=64, duration=1, headers=headers, scratch=scratch)

    runs: list[c.WrkResult] = []
    names = list(targets)
    for connections in CONCURRENCY:
        for round_number in range(rounds):
            order = names[round_number % len(names) :] + names[: round_number % len(names)]
            for name in order:
                url, headers = targets[name]
                result = c.wrk(
                    url,
                    label=name,
                    connections=connections,
                    duration=duration,
                    headers=headers,
                    cpu=WRK_CPU,
                    scratch=scratch,
                )
                runs.append(result)
                print(
                    f"  c={connections:<3} round {round_number + 1}/{rounds} {name:<32} "
                    f"{result.rps:>9.0f} req/s  p50 {result.p50_ms:.2f} ms  "
                    f"p99 {result.p99_ms:.2f} ms",
                    flush=True,
                )

    by_concurrency: dict[str, dict[str, Any]] = {}
    rows = []
    for connections in CONCURRENCY:
        entry: dict[str, Any] = {}
        for name in names:
            mine = [r for r in runs if r.label == name and r.connections == connections]
            entry[name] = {
                "rps": round(c.median(r.rps for r in mine)),
                "p50_ms": round(c.median(r.p50_ms for r in mine), 3),
                "p99_ms": round(c.median(r.p99_ms for r in mine), 3),
                "rps_runs": [round(r.rps) for r in mine],
            }
            rows.append(
                [
                    name,
                    connections,
                    entry[name]["rps"],
                    entry[name]["p50_ms"],
                    entry[name]["p99_ms"],
                    " ".join(str(x) for x in entry[name]["rps_runs"]),
                ]
            )
        entry["ratio_vs_fastapi"] = c.ratio(
            entry["ours_key"]["rps"], entry["fastapi_constant"]["rps"]
        )
        entry["ratio_vs_bare_asgi"] = c.ratio(entry["ours_key"]["rps"], entry["bare_asgi"]["rps"])
        entry["ratio_jwt_vs_key"] = c.ratio(entry["ours_jwt"]["rps"], entry["ours_key"]["rps"])
        entry["ratio_cookie_vs_key"] = c.ratio(
            entry["ours_cookie"]["rps"], entry["ours_key"]["rps"]
        )
        by_concurrency[f"c{connections}"] = entry

    top = by_concurrency[f"c{CONCURRENCY[-1]}"]
    results: dict[str, Any] = {
        "ours_rps": top["ours_key"]["rps"],
        "fastapi_constant_rps": top["fastapi_constant"]["rps"],
        "bare_asgi_rps": top["bare_asgi"]["rps"],
        "ratio_vs_fastapi": top["ratio_vs_fastapi"],
        "ratio_vs_bare_asgi": top["ratio_vs_bare_asgi"],
        "p50_ms": top["ours_key"]["p50_ms"],
        "p99_ms": top["ours_key"]["p99_ms"],
        "jwt_rps": top["ours_jwt"]["rps"],
        "ratio_jwt_vs_key": top["ratio_jwt_vs_key"],
        "cookie_rps": top["ours_cookie"]["rps"],
        "ratio_cookie_vs_key": top["ratio_cookie_vs_key"],
        "goals": {
            "ratio_vs_fastapi >= 1.0": top["ratio_vs_fastapi"] >= 1.0,
            "ratio_vs_bare_asgi >= 0.35": top["ratio_vs_bare_asgi"] >= 0.35,
            "ratio_jwt_vs_key >= 0.9": top["ratio_jwt_vs_key"] >= 0.9,
            "ratio_cookie_vs_key >= 0.9": top["ratio_cookie_vs_key"] >= 0.9,
            "p99_ms <= 15": top["ours_key"]["p99_ms"] <= 15,
        },
        "gaps": status_gaps(top),
        "by_concurrency": by_concurrency,
        "params": {
            "duration_s": duration,
            "rounds": rounds,
            "concurrency": list(CONCURRENCY),
            "server_cpu": SERVER_CPU if c.taskset_prefix("0") else None,
            "wrk_cpu": WRK_CPU if c.taskset_prefix("1") else None,
            "wrk_threads": 1,
            "ours_rss_kb_after": ours.rss_kb(),
        },
        "runs": runs,
    }
    c.print_table(
        "status poll (median over rounds; rps runs in order)",
        ["target", "c", "req/s", "p50 ms", "p99 ms", "runs req/s"],
        rows,
    )
    c.print_table(
        f"headline (c={CONCURRENCY[-1]})",
        ["key", "value"],
        [[k, results[k]] for k in [*KEYS, "ratio_cookie_vs_key"]],
    )
    c.write_json(c.json_path(NAME, args), NAME, args, results)


if __name__ == "__main__":
    c.main_guard(run, NAME, __doc__, needs_wrk=True)

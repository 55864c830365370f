"""Overload, bounded: one client floods a real server far past its limits while another polls
politely. The flood gets 429 with Retry-After (never a 5xx, never a dropped connection), the
polite client keeps getting 200, the server's memory stays bounded and it keeps running.
(The long soak lives in bench/, not here.)
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from serve_process import new_account, started_server

FLOOD_REQUESTS = 3000
FLOOD_CONCURRENCY = 64


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def _flood(base: str, chat: str, key: str) -> dict[int, int]:
    codes: dict[int, int] = {}
    limits = httpx.Limits(max_connections=FLOOD_CONCURRENCY)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=30) as client:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for n in range(FLOOD_REQUESTS):
            queue.put_nowait(n)

        async def worker() -> None:
            while not queue.empty():
                queue.get_nowait()
                response = await client.get(
                    f"/v1/sandbox/{chat}/status", headers={"X-Ivy-Api-Key": key}
                )
                codes[response.status_code] = codes.get(response.status_code, 0) + 1
                if response.status_code == 429:
                    assert int(response.headers["retry-after"]) >= 1

        await asyncio.gather(*(worker() for _ in range(FLOOD_CONCURRENCY)))
    return codes


async def _polite(base: str, chat: str, key: str, stop: asyncio.Event) -> list[int]:
    codes: list[int] = []
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        while not stop.is_set():
            response = await client.get(
                f"/v1/sandbox/{chat}/status", headers={"X-Ivy-Api-Key": key}
            )
            codes.append(response.status_code)
            await asyncio.sleep(0.5)
    return codes


def test_a_flood_is_refused_with_429_while_a_polite_client_keeps_working(tmp_path: Path) -> None:
    server = started_server(
        tmp_path,
        {"IVY_RATE_LIMIT": "300/minute", "IVY_RATE_LIMIT_PER_CHAT": "120/minute"},
    )
    try:
        flooder, polite = new_account(server), new_account(server)
        assert server.process is not None
        before = rss_kib(server.process.pid)

        async def scenario() -> tuple[dict[int, int], list[int]]:
            stop = asyncio.Event()
            polite_task = asyncio.create_task(
                _polite(server.base_url, polite.chat, polite.key, stop)
            )
            flood_codes = await _flood(server.base_url, flooder.chat, flooder.key)
            stop.set()
            return flood_codes, await polite_task

        flood_codes, polite_codes = asyncio.run(scenario())
        assert set(flood_codes) <= {200, 429}, flood_codes
        assert flood_codes.get(429, 0) >= FLOOD_REQUESTS - 300  # the limit held
        assert polite_codes
        assert set(polite_codes) == {200}
        assert server.process.poll() is None  # still running
        assert rss_kib(server.process.pid) - before < 64 * 1024  # bounded growth (< 64 MiB)
    finally:
        server.stop()

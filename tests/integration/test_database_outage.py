"""The database goes away for a while: requests fail with 503 and Retry-After (never 500),
and the service recovers by itself when it comes back.

The outage is real but local: the app reaches PostgreSQL through a small TCP proxy owned by
the test, which drops every connection while "down" and forwards again when "up" (stopping
the machine's PostgreSQL would disturb every other test).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest
from sqlalchemy.engine import make_url

from conftest import World
from ivy_sandbox.bootstrap import Services
from ivy_sandbox.storage.engine import create_engine
from ivy_sandbox.storage.repository import Repository


class FlakyProxy:
    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.up = True
        self.connections: set[asyncio.StreamWriter] = set()
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.up:
            writer.close()
            return
        upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        self.connections |= {writer, upstream_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))

    def go_down(self) -> None:
        self.up = False
        for connection in self.connections:
            connection.close()
        self.connections.clear()

    async def aclose(self) -> None:
        self.go_down()
        if self.server is not None:
            self.server.close()


@pytest.fixture
async def proxy(database_url: str) -> AsyncIterator[FlakyProxy]:
    if not database_url.startswith("postgresql"):
        pytest.skip("the outage is simulated on the network path to the database server")
    url = make_url(database_url)
    flaky = FlakyProxy(url.host or "127.0.0.1", url.port or 5432)
    await flaky.start()
    yield flaky
    await flaky.aclose()


@pytest.mark.postgres
async def test_requests_get_503_with_retry_after_while_the_database_is_down_and_recover(
    client: httpx.AsyncClient,
    world: World,
    services: Services,
    proxy: FlakyProxy,
    database_url: str,
) -> None:
    key, chat = await world.key(), await world.chat()
    assert proxy.server is not None
    port = proxy.server.sockets[0].getsockname()[1]
    through_proxy = make_url(database_url).set(host="127.0.0.1", port=port)
    original = services.repository
    services.repository = Repository(
        create_engine(through_proxy.render_as_string(hide_password=False))
    )
    services.authenticator._repository = services.repository
    headers = {"X-Ivy-Api-Key": key}
    url = f"/v1/sandbox/{chat}/status"
    try:
        assert (await client.get(url, headers=headers)).status_code == 200
        proxy.go_down()
        services.authenticator.forget_cached_keys()
        for _ in range(3):
            down = await client.get(url, headers=headers)
            assert down.status_code == 503
            assert down.headers["retry-after"] == "5"
            assert down.json()["code"] == "unavailable"
        ready = await client.get("/readyz")
        assert ready.status_code == 503
        proxy.up = True
        recovered = None
        for _ in range(50):
            recovered = await client.get(url, headers=headers)
            if recovered.status_code == 200:
                break
            await asyncio.sleep(0.1)
        assert recovered is not None
        assert recovered.status_code == 200
        assert recovered.json() == {"status": "none"}
        assert (await client.get("/readyz")).status_code == 200
    finally:
        await services.repository.engine.dispose()
        services.repository = original
        services.authenticator._repository = original

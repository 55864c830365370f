"""Shared fixtures: a real database (SQLite always; PostgreSQL when IVY_TEST_POSTGRES_URL is
set), a real limiter storage paired with it (memory with SQLite; Redis with PostgreSQL when
IVY_TEST_REDIS_URL is set), the app wired with a fake clock, and helpers to create users,
chats, keys, sandboxes and session tokens.

Every API test runs once per backend pair: ``database_url`` is parametrized over SQLite and
PostgreSQL, and ``limiter_storage_url`` follows it.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from limits.aio.storage import RedisStorage
from sqlalchemy import delete, insert
from sqlalchemy.engine import make_url

from fakes import FakeClock
from ivy_sandbox.api.app import create_app
from ivy_sandbox.auth.clerk import ClerkVerifier
from ivy_sandbox.backends.base import SandboxBackend
from ivy_sandbox.backends.fake import FakeBackend
from ivy_sandbox.bootstrap import Services
from ivy_sandbox.config import Settings
from ivy_sandbox.ratelimit import RateLimiter, make_storage
from ivy_sandbox.services import accounts
from ivy_sandbox.services.authentication import Authenticator
from ivy_sandbox.storage.engine import create_engine
from ivy_sandbox.storage.migrate import migrate
from ivy_sandbox.storage.repository import Repository
from ivy_sandbox.storage.tables import api_keys, chats, phase_stats, projects, sandboxes, users
from ivy_sandbox.workers.provisioner import Provisioner
from ivy_sandbox.workers.steps import EngineSettings

POSTGRES_URL = os.environ.get("IVY_TEST_POSTGRES_URL")
REDIS_URL = os.environ.get("IVY_TEST_REDIS_URL")
# CI sets this: a missing PostgreSQL or Redis is then a failure, not a skip.
REQUIRE_SERVICES = os.environ.get("IVY_TEST_REQUIRE_SERVICES") == "1"
PEPPER = b"test-pepper"


def service_unavailable(reason: str) -> None:
    """Skip (on a laptop without the service) or fail (in CI, which must have it)."""
    if REQUIRE_SERVICES:
        pytest.fail(f"{reason}, but IVY_TEST_REQUIRE_SERVICES=1")
    pytest.skip(reason)


ISSUER = "https://clerk.test.example"
AZP = "https://app.test.example"


# -- databases -------------------------------------------------------------------------------
def _asyncpg_url(url: str) -> str:
    return str(make_url(url).set(drivername="postgresql+asyncpg"))


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated SQLite file, copied for each test (migrating per test would be slow)."""
    path = tmp_path_factory.mktemp("template") / "template.db"

    async def build() -> None:
        engine = create_engine(f"sqlite+aiosqlite:///{path}")
        await migrate(engine)
        await engine.dispose()

    asyncio.run(build())
    return path


@pytest.fixture(scope="session")
def postgres_database() -> Iterator[str]:
    """A fresh, migrated PostgreSQL database for this test session, dropped afterwards."""
    if not POSTGRES_URL:
        service_unavailable("IVY_TEST_POSTGRES_URL is not set (no PostgreSQL for this run)")
    import asyncpg

    admin_url = make_url(POSTGRES_URL).set(drivername="postgresql")
    name = f"ivy_test_{uuid.uuid4().hex[:12]}"

    async def admin(sql: str) -> None:
        conn = await asyncpg.connect(admin_url.render_as_string(hide_password=False))
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    async def create() -> str:
        await admin(f'CREATE DATABASE "{name}"')
        url = _asyncpg_url(admin_url.set(database=name).render_as_string(hide_password=False))
        engine = create_engine(url)
        await migrate(engine)
        await engine.dispose()
        return url

    url = asyncio.run(create())
    yield url
    asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        target = tmp_path / "ivy.db"
        shutil.copy(request.getfixturevalue("sqlite_template"), target)
        return f"sqlite+aiosqlite:///{target}"
    url: str = request.getfixturevalue("postgres_database")
    return url


@pytest.fixture
async def repository(database_url: str) -> AsyncIterator[Repository]:
    engine = create_engine(database_url)
    async with engine.begin() as conn:  # PostgreSQL is shared by the session: start clean
        for table in (sandboxes, api_keys, chats, projects, users, phase_stats):
            await conn.execute(delete(table))
    yield Repository(engine)
    await engine.dispose()


# -- session tokens --------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenFactory:
    private_key: rsa.RSAPrivateKey
    public_pem: str
    clock: FakeClock

    def claims(self, user_id: str = "user_alice", **overrides: Any) -> dict[str, Any]:
        now = int(self.clock.time())
        claims: dict[str, Any] = {
            "sub": user_id,
            "sid": "sess_123",
            "iat": now - 1,
            "nbf": now - 1,
            "exp": now + 60,
            "iss": ISSUER,
            "azp": AZP,
        }
        claims.update(overrides)
        return {k: v for k, v in claims.items() if v is not None}

    def token(
        self,
        user_id: str = "user_alice",
        *,
        headers: dict[str, Any] | None = None,
        key: Any = None,
        algorithm: str = "RS256",
        **claims: Any,
    ) -> str:
        header = {"kid": "test-key", "typ": "JWT"} | (headers or {})
        return jwt.encode(
            self.claims(user_id, **claims),
            key if key is not None else self.private_key,
            algorithm=algorithm,
            headers=header,
        )


@pytest.fixture(scope="session")
def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture
def clock() -> FakeClock:
    # Real "now" so PyJWT's own checks and ours agree; tests move it forward explicitly.
    return FakeClock(datetime.fromtimestamp(int(time.time())).astimezone())


@pytest.fixture
def tokens(rsa_key: rsa.RSAPrivateKey, clock: FakeClock) -> TokenFactory:
    pem = rsa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return TokenFactory(rsa_key, pem.decode(), clock)


# -- the app ---------------------------------------------------------------------------------
@pytest.fixture
def limiter_storage_url(database_url: str) -> str | None:
    """The limiter storage paired with the test's database, as deployments pair them.

    The SQLite variant keeps the embedded default (in-memory counters); the PostgreSQL variant
    counts in Redis when IVY_TEST_REDIS_URL is set. So every API test runs on SQLite + memory
    and on PostgreSQL + Redis, without a second parameter doubling the number of tests. With
    a database server but no Redis (a laptop), the PostgreSQL variant counts in memory; CI
    (IVY_TEST_REQUIRE_SERVICES=1) fails instead.
    """
    if make_url(database_url).get_backend_name() == "sqlite":
        return None
    if not REDIS_URL:
        if REQUIRE_SERVICES:
            service_unavailable("IVY_TEST_REDIS_URL is not set (no Redis for this run)")
        return None
    return REDIS_URL


@pytest.fixture
def limits() -> dict[str, str]:
    """Rate limits for the app under test: high, so only rate-limit tests ever hit them."""
    return {"per_user": "10000/minute", "per_chat": "10000/minute", "auth_failures": "10000/minute"}


@pytest.fixture
async def limiter(
    limits: dict[str, str], limiter_storage_url: str | None
) -> AsyncIterator[RateLimiter]:
    """The app's limiter, on the storage ``limiter_storage_url`` pairs with the database.

    On Redis each test has its own key prefix (no counter is shared with another test or a
    parallel run), and deletes its own keys afterwards.
    """
    if limiter_storage_url is None:
        yield RateLimiter(make_storage(None), **limits)
        return
    limiter = make_redis_limiter(limits, limiter_storage_url)
    try:
        yield limiter
    finally:
        await drop_redis_limiter(limiter)


def make_redis_limiter(limits: dict[str, str], redis_url: str | None = None) -> RateLimiter:
    """A limiter on Redis whose keys carry a prefix unique to this call."""
    url = redis_url or REDIS_URL
    assert url
    prefix = f"ivy-test-{uuid.uuid4().hex}"
    return RateLimiter(make_storage(url, key_prefix=prefix), **limits)


async def drop_redis_limiter(limiter: RateLimiter) -> None:
    """Delete the keys under the limiter's own prefix (only those) and close its connections."""
    storage = limiter.storage
    assert isinstance(storage, RedisStorage)
    try:
        await storage.reset()
    finally:
        await storage.bridge.storage.aclose()


@pytest.fixture
async def services(
    tmp_path: Path,
    repository: Repository,
    tokens: TokenFactory,
    clock: FakeClock,
    limiter: RateLimiter,
    backend: SandboxBackend,
) -> AsyncIterator[Services]:
    settings = Settings(data_dir=tmp_path, api_key_pepper=PEPPER.decode())
    clerk = ClerkVerifier(
        pem=tokens.public_pem,
        issuer=ISSUER,
        authorized_parties=frozenset({AZP}),
        clock=clock.time,
    )
    authenticator = Authenticator(repository, PEPPER, clerk, clock)
    wired = Services(settings, repository, authenticator, limiter, clerk, clock, backend)
    yield wired
    if wired.provisioner is not None:
        await wired.provisioner.aclose()
    await clerk.aclose()
    await limiter.aclose()


@pytest.fixture
def backend() -> SandboxBackend:
    """The sandbox backend under the app: the fake one unless a test module overrides it."""
    return FakeBackend()


@pytest.fixture
def engine_settings() -> EngineSettings:
    return EngineSettings(
        capacity_timeout=5, compute_timeout=5, mount_timeout=5, ready_timeout=5, lease_ttl=3
    )


@pytest.fixture
async def worker(services: Services, engine_settings: EngineSettings) -> Provisioner:
    """A running provisioning worker wired into ``services`` (launches get driven)."""
    provisioner = Provisioner(
        services.sandboxes,
        services.backend,
        services.clock,
        engine_settings,
        poll_interval=0.05,
        monitor_interval=0.05,
    )
    services.provisioner = provisioner
    await provisioner.start()
    return provisioner


@pytest.fixture
async def client(services: Services) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(services.settings, services=services)
    transport = httpx.ASGITransport(app=app, client=("203.0.113.7", 40000))
    async with httpx.AsyncClient(transport=transport, base_url="http://ivy.test") as c:
        yield c


# -- data helpers ----------------------------------------------------------------------------
@dataclass
class World:
    """Creates users, projects, chats, keys and sandbox rows through the real use cases."""

    repository: Repository
    clock: FakeClock

    async def user(self, user_id: str = "user_alice") -> str:
        if not await self.repository.user_exists(user_id):
            await accounts.create_user(self.repository, self.clock, user_id)
        return user_id

    async def project(self, user_id: str = "user_alice", name: str = "proj") -> str:
        await self.user(user_id)
        return (await accounts.create_project(self.repository, self.clock, user_id, name)).id

    async def chat(self, user_id: str = "user_alice", project_id: str | None = None) -> str:
        await self.user(user_id)
        chat = await accounts.create_chat(self.repository, self.clock, user_id, project_id)
        return chat.id

    async def key(
        self,
        user_id: str = "user_alice",
        project_id: str | None = None,
        expires_in: timedelta | None = None,
    ) -> str:
        await self.user(user_id)
        created = await accounts.create_api_key(
            self.repository,
            self.clock,
            PEPPER,
            user_id,
            project_id=project_id,
            expires_in=expires_in,
        )
        return created.key

    async def sandbox(self, chat_id: str, status: str, phase: str, **fields: Any) -> None:
        now = self.clock.now()
        values: dict[str, Any] = {
            "id": f"sbx_{uuid.uuid4().hex[:20]}",
            "chat_id": chat_id,
            "status": status,
            "phase": phase,
            "created_at": now,
            "phase_started_at": now,
            "updated_at": now,
            "backend": "test",
            "backend_state": {},
        }
        values.update(fields)
        async with self.repository.engine.begin() as conn:
            await conn.execute(insert(sandboxes).values(**values))


@pytest.fixture
def world(repository: Repository, clock: FakeClock) -> World:
    return World(repository, clock)


@pytest.fixture
def bearer() -> Callable[[str], dict[str, str]]:
    return lambda credential: {"Authorization": f"Bearer {credential}"}


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
    """Tests marked ``both_loops`` (real sandboxes) run on asyncio and on uvloop: `serve` runs
    on uvloop (uvicorn[standard]) and the backend must work there too."""
    if item.get_closest_marker("both_loops") is None:
        return {"asyncio": asyncio.new_event_loop}
    import uvloop

    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


# -- metrics -----------------------------------------------------------------------------------
def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text format (0 when absent)."""
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        match = re.match(r"^([a-z_]+)(\{.*\})? (\S+)$", line)
        if match is None or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    return 0.0

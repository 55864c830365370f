"""The one place that wires collaborators together (settings → engine, repository, …).

The app factory, the worker and the admin CLI all build their services here, so they agree
on the database, the pepper and the limits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ivy_sandbox.auth.clerk import ClerkVerifier
from ivy_sandbox.backends.base import ResourceLimits, SandboxBackend
from ivy_sandbox.backends.fake import latency_backend
from ivy_sandbox.config import Settings, api_key_pepper, ensure_data_dir
from ivy_sandbox.events import EventBus, LocalEventBus, make_event_bus
from ivy_sandbox.ratelimit import RateLimiter, make_storage
from ivy_sandbox.services.authentication import Authenticator
from ivy_sandbox.services.clock import Clock, SystemClock
from ivy_sandbox.services.sandboxes import SandboxContext
from ivy_sandbox.services.watch import KEEPALIVE_SECONDS, Watching
from ivy_sandbox.storage.engine import create_engine
from ivy_sandbox.storage.migrate import migrate
from ivy_sandbox.storage.repository import Repository
from ivy_sandbox.storage.sandboxes import SandboxRepository
from ivy_sandbox.workers.provisioner import Provisioner
from ivy_sandbox.workers.steps import EngineSettings

log = logging.getLogger(__name__)


@dataclass
class Services:
    settings: Settings
    repository: Repository
    authenticator: Authenticator
    limiter: RateLimiter
    clerk: ClerkVerifier
    clock: Clock
    backend: SandboxBackend
    provisioner: Provisioner | None = None
    bus: EventBus = field(default_factory=LocalEventBus)
    sandboxes: SandboxRepository = field(init=False)

    def __post_init__(self) -> None:
        self.sandboxes = SandboxRepository(self.repository.engine, self.bus)

    @property
    def sandbox_context(self) -> SandboxContext:
        return SandboxContext(
            repository=self.repository,
            sandboxes=self.sandboxes,
            backend=self.backend,
            limiter=self.limiter,
            clock=self.clock,
            kick_worker=self.provisioner.kick if self.provisioner else _no_worker,
        )

    @property
    def pepper(self) -> bytes:
        """The API-key HMAC pepper: new keys must be hashed with what verification uses."""
        return self.authenticator.pepper

    @property
    def watching(self) -> Watching:
        # Events always reach us when every change is made in this process or announced
        # through PostgreSQL; otherwise (SQLite + separate workers) look once a second.
        reliable = self.bus.cross_process or self.provisioner is not None
        return Watching(
            repository=self.repository,
            bus=self.bus,
            limiter=self.limiter,
            clock=self.clock,
            recheck_seconds=KEEPALIVE_SECONDS if reliable else 1.0,
        )

    async def start(self) -> None:
        """Start what runs in the background: the event listener, then the worker."""
        await self.bus.start()
        if self.provisioner is not None:
            await self.provisioner.start()

    async def aclose(self) -> None:
        if self.provisioner is not None:
            await self.provisioner.aclose()
        await self.bus.aclose()
        await self.backend.aclose()
        await self.clerk.aclose()
        await self.limiter.aclose()
        await self.repository.dispose()


def _no_worker() -> None:
    """No in-process worker: separate `ivy-sandbox worker` processes poll for launches."""


def engine_settings(settings: Settings) -> EngineSettings:
    return EngineSettings(
        max_sandboxes=settings.max_sandboxes,
        capacity_timeout=settings.capacity_timeout,
        compute_timeout=settings.compute_timeout,
        mount_timeout=settings.mount_timeout,
        ready_timeout=settings.ready_timeout,
        idle_timeout=settings.sandbox_idle_timeout,
        network=settings.sandbox_network,
        limits=ResourceLimits(
            memory_bytes=settings.sandbox_memory_bytes,
            pids=settings.sandbox_pids,
            cpus=settings.sandbox_cpus,
        ),
    )


def make_backend(settings: Settings) -> SandboxBackend:
    """The configured backend. ``latency-fake`` runs nothing: it exists for benchmarks."""
    if settings.sandbox_backend == "latency-fake":
        return latency_backend()
    from ivy_sandbox.backends.local import LocalBackend

    backend = LocalBackend(
        ensure_data_dir(settings).resolve(), disk_bytes=settings.sandbox_disk_bytes
    )
    log.info("local sandboxes: limits enforced by %s", backend.enforced_limits().summary())
    return backend


async def open_repository(settings: Settings, *, run_migrations: bool = True) -> Repository:
    ensure_data_dir(settings)
    engine = create_engine(settings.effective_database_url)
    if run_migrations:
        await migrate(engine)
    return Repository(engine)


def clerk_verifier(settings: Settings) -> ClerkVerifier:
    """The session-token verifier; raises ConfigurationError for an unusable key."""
    return ClerkVerifier(
        pem=settings.clerk_jwt_key,
        jwks_url=settings.clerk_jwks_url,
        issuer=settings.clerk_issuer,
        authorized_parties=settings.clerk_authorized_parties,
    )


async def preflight(settings: Settings) -> None:
    """Everything that can be wrong before serving: data dir, pepper, keys, database, and
    (when this process drives launches) whether sandboxes can run on this host.

    ``serve`` runs this first so that a bad setting ends start-up with one clear line
    instead of a traceback from inside the server's lifespan.
    """
    api_key_pepper(settings)
    await clerk_verifier(settings).aclose()
    repository = await open_repository(settings)
    await repository.dispose()
    if settings.run_worker:  # this process will start sandboxes: can it? (BackendError)
        await make_backend(settings).aclose()


async def build_services(
    settings: Settings, clock: Clock | None = None, *, with_worker: bool = False
) -> Services:
    clock = clock or SystemClock()
    repository = await open_repository(settings)
    clerk = clerk_verifier(settings)
    limiter = RateLimiter(
        make_storage(settings.redis_url),
        per_user=settings.rate_limit,
        per_chat=settings.rate_limit_per_chat,
        auth_failures=settings.auth_failure_limit,
        per_launch=settings.rate_limit_launch,
    )
    authenticator = Authenticator(repository, api_key_pepper(settings), clerk, clock)
    backend = make_backend(settings)
    bus = make_event_bus(settings.effective_database_url)
    services = Services(
        settings, repository, authenticator, limiter, clerk, clock, backend, bus=bus
    )
    if with_worker:
        services.provisioner = Provisioner(
            services.sandboxes, backend, clock, engine_settings(settings)
        )
    return services

"""The one place that wires collaborators together (settings → engine, repository, …).

The app factory, the worker and the admin CLI all build their services here, so they agree
on the database, the pepper and the limits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ivy_sandbox.auth.clerk import ClerkVerifier
from ivy_sandbox.config import Settings, api_key_pepper, ensure_data_dir
from ivy_sandbox.ratelimit import RateLimiter, make_storage
from ivy_sandbox.services.authentication import Authenticator
from ivy_sandbox.services.clock import Clock, SystemClock
from ivy_sandbox.storage.engine import create_engine
from ivy_sandbox.storage.migrate import migrate
from ivy_sandbox.storage.repository import Repository


@dataclass
class Services:
    settings: Settings
    repository: Repository
    authenticator: Authenticator
    limiter: RateLimiter
    clerk: ClerkVerifier
    clock: Clock = field(default_factory=SystemClock)

    async def aclose(self) -> None:
        await self.clerk.aclose()
        await self.limiter.aclose()
        await self.repository.engine.dispose()


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
    """Everything that can be wrong before serving: data dir, pepper, keys, database.

    ``serve`` runs this first so that a bad setting ends start-up with one clear line
    instead of a traceback from inside the server's lifespan.
    """
    api_key_pepper(settings)
    await clerk_verifier(settings).aclose()
    repository = await open_repository(settings)
    await repository.engine.dispose()


async def build_services(settings: Settings, clock: Clock | None = None) -> Services:
    clock = clock or SystemClock()
    repository = await open_repository(settings)
    clerk = clerk_verifier(settings)
    limiter = RateLimiter(
        make_storage(settings.redis_url),
        per_user=settings.rate_limit,
        per_chat=settings.rate_limit_per_chat,
        auth_failures=settings.auth_failure_limit,
    )
    authenticator = Authenticator(repository, api_key_pepper(settings), clerk, clock)
    return Services(settings, repository, authenticator, limiter, clerk, clock)

"""Readiness checks and scrape-time gauges for operators."""

from __future__ import annotations

import asyncio
import hmac
import logging

from ivy_sandbox.backends.base import SandboxBackend
from ivy_sandbox.domain.sandbox import SandboxStatus
from ivy_sandbox.metrics import SANDBOXES
from ivy_sandbox.storage.repository import Repository
from ivy_sandbox.storage.sandboxes import SandboxRepository

log = logging.getLogger(__name__)
CHECK_SECONDS = 2.0


async def readiness(repository: Repository, backend: SandboxBackend) -> dict[str, str]:
    """``{"database": "ok"|"unavailable", "backend": "ok"|"unavailable"}``."""
    checks = {"database": "ok", "backend": "ok"}
    try:
        await asyncio.wait_for(repository.ping(), CHECK_SECONDS)
    except Exception as exc:
        log.warning("readiness: database check failed: %s", type(exc).__name__)
        checks["database"] = "unavailable"
    try:
        backend.enforced_limits()  # cheap; raises if the backend cannot work at all
    except Exception as exc:
        log.warning("readiness: backend check failed: %s", type(exc).__name__)
        checks["backend"] = "unavailable"
    return checks


async def refresh_sandbox_gauges(sandboxes: SandboxRepository) -> None:
    counts = await sandboxes.count_by_status()
    for status in (SandboxStatus.PROVISIONING, SandboxStatus.ACTIVE, SandboxStatus.FAILED):
        SANDBOXES.labels(status.value).set(counts.get(status, 0))


def token_matches(authorization: str, expected: str) -> bool:
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip(), expected)

"""Schemathesis over our own /openapi.json: every operation, with valid credentials and
without. No 5xx, and every response matches the documented status codes and schemas.

The app runs with its real lifespan (SQLite in a tmp dir, the latency-fake backend so
launches do not start real processes, limits high enough never to trip), driven by
schemathesis' ASGI client.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import (
    negative_data_rejection,
    positive_data_acceptance,
)

from ivy_sandbox.api.app import create_app
from ivy_sandbox.bootstrap import open_repository
from ivy_sandbox.config import Settings
from ivy_sandbox.services import accounts
from ivy_sandbox.services.clock import SystemClock

PEPPER = "fuzz-pepper"


def _seed(settings: Settings) -> tuple[str, str]:
    async def seed() -> tuple[str, str]:
        repository = await open_repository(settings)
        clock = SystemClock()
        try:
            await accounts.create_user(repository, clock, "user_fuzz")
            chat = await accounts.create_chat(repository, clock, "user_fuzz")
            key = await accounts.create_api_key(repository, clock, PEPPER.encode(), "user_fuzz")
            return chat.id, key.key
        finally:
            await repository.engine.dispose()

    return asyncio.run(seed())


def _build_app() -> tuple[Any, str]:
    # Built at import: schemathesis needs the schema when the tests are collected.
    data_dir = Path(tempfile.mkdtemp(prefix="ivy-fuzz-"))
    settings = Settings(
        data_dir=data_dir,
        api_key_pepper=PEPPER,
        sandbox_backend="latency-fake",
        rate_limit="100000/minute",
        rate_limit_per_chat="100000/minute",
        auth_failure_limit="100000/minute",
        rate_limit_launch="100000/minute",
        log_format="text",
    )
    _, key = _seed(settings)
    return create_app(settings), key


APP, KEY = _build_app()
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@schema.parametrize()
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_every_operation_answers_as_documented_with_a_valid_key(case: Any) -> None:
    case.call_and_validate(
        headers={"Authorization": f"Bearer {KEY}"},
        excluded_checks=[negative_data_rejection, positive_data_acceptance],
    )


@schema.parametrize()
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_operation_answers_as_documented_without_credentials(case: Any) -> None:
    case.headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}
    case.call_and_validate(excluded_checks=[negative_data_rejection, positive_data_acceptance])

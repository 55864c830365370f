"""The sandbox settings reach what uses them: ``IVY_*`` → EngineSettings → each launch's
SandboxSpec (network, limits) and the engine's timeouts; and the documented defaults."""

from __future__ import annotations

import asyncio
import os
from datetime import UTC, datetime
from typing import Any

import pytest

from ivy_sandbox.backends.base import ResourceLimits
from ivy_sandbox.backends.fake import FakeBackend
from ivy_sandbox.bootstrap import engine_settings
from ivy_sandbox.config import load_settings
from ivy_sandbox.domain.sandbox import Phase, SandboxStatus
from ivy_sandbox.storage.sandboxes import SandboxRecord
from ivy_sandbox.workers.steps import EngineSettings, LaunchDriver

SANDBOX_VARIABLES = {
    "IVY_MAX_SANDBOXES": "3",
    "IVY_CAPACITY_TIMEOUT": "4",
    "IVY_COMPUTE_TIMEOUT": "7",
    "IVY_MOUNT_TIMEOUT": "8",
    "IVY_READY_TIMEOUT": "9",
    "IVY_SANDBOX_IDLE_TIMEOUT": "11",
    "IVY_SANDBOX_NETWORK": "true",
    "IVY_SANDBOX_MEMORY": "1G",
    "IVY_SANDBOX_PIDS": "100",
    "IVY_SANDBOX_CPUS": "0.5",
}


@pytest.fixture(autouse=True)
def no_ivy_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    for name in list(os.environ):
        if name.startswith("IVY_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("IVY_DATA_DIR", str(tmp_path))


def test_the_documented_sandbox_defaults() -> None:
    engine = engine_settings(load_settings())
    assert engine.max_sandboxes == 50
    assert engine.idle_timeout == 900  # 15 minutes
    assert engine.network is False  # no network unless asked for
    assert (engine.compute_timeout, engine.mount_timeout, engine.ready_timeout) == (60, 30, 30)
    assert engine.limits == ResourceLimits(memory_bytes=512 * 1024**2, pids=256, cpus=1.0)
    assert load_settings().sandbox_backend == "local"


def test_every_sandbox_variable_reaches_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SANDBOX_VARIABLES.items():
        monkeypatch.setenv(name, value)
    engine = engine_settings(load_settings())
    assert (engine.max_sandboxes, engine.capacity_timeout) == (3, 4)
    assert (engine.compute_timeout, engine.mount_timeout, engine.ready_timeout) == (7, 8, 9)
    assert engine.idle_timeout == 11
    assert engine.network is True
    assert engine.limits == ResourceLimits(memory_bytes=1024**3, pids=100, cpus=0.5)


async def test_each_launch_asks_the_backend_for_the_configured_network_and_limits() -> None:
    limits = ResourceLimits(memory_bytes=1024**3, pids=100, cpus=0.5)
    now = datetime.now(UTC)
    record = SandboxRecord(
        id="sbx_wiring",
        chat_id="chat_wiring",
        status=SandboxStatus.PROVISIONING,
        phase=Phase.COMPUTE,
        error_code=None,
        error_message=None,
        eta_seconds=None,
        created_at=now,
        phase_started_at=now,
        ready_at=None,
        last_activity_at=None,
        updated_at=now,
        backend="fake",
        backend_state={},
        lease_owner="worker",
        lease_expires_at=None,
        admitted_at=None,
    )
    driver = LaunchDriver(
        record,
        "worker",
        sandboxes=None,  # type: ignore[arg-type] - only the spec is looked at here
        backend=FakeBackend(),
        clock=None,  # type: ignore[arg-type]
        settings=EngineSettings(network=True, limits=limits),
        capacity_freed=asyncio.Event(),
    )
    assert (driver.spec.sandbox_id, driver.spec.chat_id) == ("sbx_wiring", "chat_wiring")
    assert driver.spec.network is True
    assert driver.spec.limits == limits

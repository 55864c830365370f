"""kill -9 of the server (and of a separate worker) during and after launches, with real
bubblewrap sandboxes: after a restart every sandbox ends active or failed with a reason, the
running ones are adopted (still usable), and no sandbox process outlives its record.

"Mid-launch" is made deterministic with IVY_MAX_SANDBOXES=1: launches queue in the compute
phase behind the first sandbox, so they are provisioning when the kill lands.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_process import (
    IVY,
    Server,
    clean_env,
    new_account,
    sandbox_pids,
    sandbox_processes_by_cgroup,
    started_server,
    until,
)


class Api:
    def __init__(self, server: Server, key: str) -> None:
        self.server = server
        self.headers = {"X-Ivy-Api-Key": key}

    def call(self, method: str, chat: str, suffix: str = "", **kwargs: Any) -> httpx.Response:
        url = f"{self.server.base_url}/v1/sandbox/{chat}{suffix}"
        return httpx.request(method, url, headers=self.headers, timeout=30, **kwargs)

    def status(self, chat: str) -> str:
        return str(self.call("GET", chat, "/status").json()["status"])

    def settled(self, chat: str) -> str | None:
        status = self.status(chat)
        return status if status in ("active", "failed") else None


@pytest.fixture
def cleanup() -> Iterator[list[Server]]:
    servers: list[Server] = []
    yield servers
    for server in servers:
        if server.process is not None and server.process.poll() is None:
            server.process.kill()
        for pid in sandbox_pids(server.data_dir):
            os.kill(pid, signal.SIGKILL)


def _require_bwrap() -> None:
    from ivy_sandbox.backends.base import BackendError
    from ivy_sandbox.backends.local import LocalBackend

    try:
        LocalBackend(Path("/tmp/ivy-bwrap-check"))
    except BackendError as exc:
        pytest.skip(f"bubblewrap cannot run here: {exc.message}")


def test_server_killed_mid_launch_and_after_launch_recovers_everything(
    tmp_path: Path, cleanup: list[Server]
) -> None:
    _require_bwrap()
    server = started_server(tmp_path, {"IVY_MAX_SANDBOXES": "1"})
    cleanup.append(server)
    account = new_account(server)
    queued = [server.admin("chats", "create", "--user", account.user) for _ in range(2)]
    api = Api(server, account.key)
    api.call("POST", account.chat)
    until(lambda: api.status(account.chat) == "active", "the first sandbox")
    for chat in queued:
        assert api.call("POST", chat).json()["status"] == "provisioning"
    assert server.process is not None
    server.process.send_signal(signal.SIGKILL)  # after one launch, in the middle of two
    server.process.wait(timeout=10)
    survivors = sandbox_pids(server.data_dir)
    assert survivors, "the active sandbox must outlive its control plane"

    server.env["IVY_MAX_SANDBOXES"] = "3"
    server.start()
    for chat in [account.chat, *queued]:
        assert until(lambda c=chat: api.settled(c), f"{chat} to settle") == "active"
    ran = api.call("POST", account.chat, "/exec", json={"command": ["ls", "/workspace"]})
    assert (ran.status_code, ran.json()["exitCode"]) == (200, 0)  # adopted, still usable
    assert survivors <= sandbox_pids(server.data_dir)  # the same processes, not a restart

    for chat in [account.chat, *queued]:
        assert api.call("DELETE", chat).json() == {"status": "none"}
    until(lambda: not sandbox_pids(server.data_dir), "every sandbox process to be gone", 10)


def test_worker_killed_mid_launch_is_replaced_and_no_process_is_orphaned(
    tmp_path: Path, cleanup: list[Server]
) -> None:
    _require_bwrap()
    env = {"IVY_RUN_WORKER": "false", "IVY_MAX_SANDBOXES": "1"}
    server = started_server(tmp_path, env)
    cleanup.append(server)
    account = new_account(server)
    second = server.admin("chats", "create", "--user", account.user)
    api = Api(server, account.key)

    def worker() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [str(IVY), "worker"],
            env=clean_env(server.data_dir, env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    first_worker = worker()
    try:
        api.call("POST", account.chat)
        until(lambda: api.status(account.chat) == "active", "the first sandbox")
        api.call("POST", second)  # queued behind the first: mid-launch
        time.sleep(0.5)
        first_worker.send_signal(signal.SIGKILL)
        first_worker.wait(timeout=10)
        assert api.status(second) == "provisioning"
        api.call("DELETE", account.chat)  # free the slot; no worker runs right now
        replacement = worker()
        try:
            assert until(lambda: api.settled(second), "the queued launch") == "active"
            assert len(sandbox_pids(server.data_dir)) >= 1
            api.call("DELETE", second)
            until(lambda: not sandbox_pids(server.data_dir), "no sandbox process left", 10)
        finally:
            replacement.kill()
            replacement.wait(timeout=10)
    finally:
        if first_worker.poll() is None:
            first_worker.kill()


def sandbox_names(data_dir: Path) -> set[str]:
    """The sandboxes that have a live process under this data dir."""
    return set(sandbox_processes_by_cgroup(data_dir).values())


def test_server_killed_while_launches_run_their_phases_recovers_every_one(
    tmp_path: Path, cleanup: list[Server]
) -> None:
    """Not queued this time: a dozen launches at once, and kill -9 as soon as the first
    sandbox process exists — the others are starting, mounting or probing. After the
    restart each chat ends active (usable) or failed with a reason, and every sandbox
    process left belongs to an active chat's sandbox; stopping them all leaves none."""
    _require_bwrap()
    server = started_server(tmp_path, {"IVY_MAX_SANDBOXES": "20"})
    cleanup.append(server)
    account = new_account(server)
    chats = [account.chat]
    chats += [server.admin("chats", "create", "--user", account.user) for _ in range(11)]
    api = Api(server, account.key)
    for chat in chats:
        assert api.call("POST", chat).status_code == 202
    until(lambda: sandbox_pids(server.data_dir), "a first sandbox process", 20)
    assert server.process is not None
    server.process.send_signal(signal.SIGKILL)
    server.process.wait(timeout=10)

    server.start()
    outcomes = {chat: until(lambda c=chat: api.settled(c), f"{chat} to settle") for chat in chats}
    for chat, outcome in outcomes.items():
        detail = api.call("GET", chat).json()
        if outcome == "failed":
            assert detail["errorCode"], detail
            assert detail["errorMessage"], detail
            continue
        ran = api.call("POST", chat, "/exec", json={"command": ["ls", "/workspace"]})
        assert (ran.status_code, ran.json()["exitCode"]) == (200, 0), (chat, ran.text)
    active = sum(outcome == "active" for outcome in outcomes.values())
    # One live sandbox per active chat, none for a failed one (no orphan).
    until(lambda: len(sandbox_names(server.data_dir)) == active, "orphans to be reaped", 15)
    for chat in chats:
        assert api.call("DELETE", chat).json() == {"status": "none"}
    until(lambda: not sandbox_pids(server.data_dir), "every sandbox process to be gone", 10)

"""`serve` enforces IVY_SANDBOX_DISK on each chat's workspace (the wiring, end to end).

The disk limit's mechanics are tested at the backend level in
tests/integration/test_sandbox_escape.py; this checks that the setting reaches it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serve_process import Server, new_account, started_server

from ivy_sandbox.backends import local_disk


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    server = started_server(tmp_path, {"IVY_SANDBOX_DISK": "16M"})
    try:
        yield server
    finally:
        server.stop()
        release_images(server.data_dir)


def release_images(data_dir: Path) -> None:
    """Unmount the workspace images this test made (the service itself keeps them)."""
    workspaces = local_disk.detect(data_dir, 16 * 1024 * 1024, uid=65534, gid=65534)
    if workspaces.limited:
        assert workspaces.release() == []


def test_serve_reports_and_enforces_the_workspace_disk_limit(server: Server) -> None:
    logs = server.logs()
    if "disk: not enforced" in logs:
        pytest.skip("this machine cannot mount workspace images (not root or no loop devices)")
    assert "disk: ext4 image per workspace" in logs
    account = new_account(server)
    headers = {"Authorization": f"Bearer {account.key}"}
    url = f"{server.base_url}/v1/sandbox/{account.chat}"
    assert httpx.post(url, headers=headers).status_code == 202
    deadline = time.monotonic() + 30
    while httpx.get(url + "/status", headers=headers).json()["status"] != "active":
        assert time.monotonic() < deadline, server.logs()
        time.sleep(0.05)
    fill = ["/bin/sh", "-c", "dd if=/dev/zero of=/workspace/big bs=1M count=64 2>&1; sync"]
    result = httpx.post(url + "/exec", headers=headers, json={"command": fill}, timeout=60)
    assert result.status_code == 200, result.text
    assert "No space left" in result.json()["stdout"]
    small = [
        "/bin/sh",
        "-c",
        "rm /workspace/big && echo ok > /workspace/small && cat /workspace/small",
    ]
    after = httpx.post(url + "/exec", headers=headers, json={"command": small}, timeout=60)
    assert after.json()["stdout"].strip() == "ok"  # still usable once emptied
    assert httpx.delete(url, headers=headers).status_code == 200

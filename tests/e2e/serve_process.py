"""A real ``ivy-sandbox serve`` subprocess and the admin CLI on its configuration (e2e tests)."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

IVY = Path(sys.executable).parent / "ivy-sandbox"
START_TIMEOUT = 20.0


def clean_env(data_dir: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("IVY_")}
    env["IVY_DATA_DIR"] = str(data_dir)
    # Workspace images stay mounted for the life of the machine (docs/local-backend.md):
    # these tests are about other things and must leave no mounts behind in their tmp dirs.
    # The disk limit itself is tested by tests/integration/test_sandbox_escape.py.
    env["IVY_SANDBOX_DISK"] = "off"
    env.update(extra or {})
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Server:
    """One ``ivy-sandbox serve`` subprocess and the admin CLI on the same configuration."""

    data_dir: Path
    env: dict[str, str]
    log_dir: Path
    port: int = 0
    process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def logs(self) -> str:
        return "".join(
            f"--- {name} ---\n{(self.log_dir / name).read_text(errors='replace')[-4000:]}"
            for name in ("serve.out", "serve.err")
            if (self.log_dir / name).exists()
        )

    def start(self) -> None:
        self.port = free_port()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with (
            open(self.log_dir / "serve.out", "wb") as out,
            open(self.log_dir / "serve.err", "wb") as err,
        ):
            self.process = subprocess.Popen(
                [str(IVY), "serve", "--port", str(self.port)],
                env=clean_env(self.data_dir, self.env),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
            )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"serve exited with {self.process.returncode}\n{self.logs()}")
            try:
                if httpx.get(f"{self.base_url}/openapi.json", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        pytest.fail(f"serve did not answer within {START_TIMEOUT} s\n{self.logs()}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def admin(self, *args: str) -> str:
        """Run ``ivy-sandbox admin ARGS`` on the server's configuration; its one stdout line."""
        result = subprocess.run(
            [str(IVY), "admin", *args],
            env=clean_env(self.data_dir, self.env),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, f"admin {args}: {result.stderr}"
        assert result.stdout.count("\n") == 1, result.stdout
        return result.stdout.strip()

    def get_status(self, chat_id: str, key: str | None, prefix: str = "/api/v1") -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.get(f"{self.base_url}{prefix}/sandbox/{chat_id}/status", headers=headers)


@dataclass(frozen=True)
class Account:
    user: str
    chat: str
    key: str


def new_account(server: Server) -> Account:
    """A user, a chat and a key, made with the admin CLI while the server runs."""
    user = f"user_{uuid.uuid4().hex[:10]}"
    server.admin("users", "create", user)
    chat = server.admin("chats", "create", "--user", user)
    key = server.admin("keys", "create", "--user", user)
    return Account(user, chat, key)


def started_server(tmp: Path, env: Mapping[str, str] | None = None) -> Server:
    server = Server(tmp / "data", dict(env or {}), tmp / "logs")
    server.start()
    return server


def until(predicate: Callable[[], Any], what: str, within: float = 30.0) -> Any:
    """Poll ``predicate`` until it is truthy (its value is returned), at most ``within`` s."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {within:g} s waiting for {what}")


# -- sandbox processes of a server's data dir ---------------------------------------------------
def sandbox_processes_by_cgroup(data_dir: Path) -> dict[int, str]:
    """pid -> sandbox id, for every process in this data dir's sandbox cgroups (the local
    backend names them ``ivy-<hash of the data dir>-<sandbox id>``)."""
    digest = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:8]
    marker = f"/ivy-{digest}-"
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "cgroup").read_text()
        except OSError:
            continue
        if marker in text:
            found[int(entry.name)] = text.split(marker, 1)[1].split("/", 1)[0].split("\n", 1)[0]
    return found


def sandbox_pids(data_dir: Path) -> set[int]:
    """Host pids in this data dir's sandbox cgroups."""
    return set(sandbox_processes_by_cgroup(data_dir))

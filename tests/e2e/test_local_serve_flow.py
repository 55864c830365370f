"""The issue's "done when", end to end: a real ``ivy-sandbox serve`` on the real local
(bubblewrap) backend, driven through the real CLI (``launch --wait``, ``exec``, ``stop``) and
HTTP, including its failure paths (each phase's watchdog, capacity) and idle reaping.

A sandbox's processes are found two ways: by cgroup (the local backend names each sandbox's
cgroups ``ivy-<hash of the data dir>-<sandbox id>``) and as descendants of the serve process
(bwrap is its child while it lives, also before it has joined any cgroup). Every test stops
its sandboxes; a fixture kills and reports anything left behind.

The phase watchdogs are set to 1 ms: each phase with the real backend runs at least one
process (bwrap, or a command inside the sandbox), which takes tens of milliseconds, and the
first wait on it lets the watchdog fire, so the phase cannot finish in time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_process import (
    IVY,
    Account,
    Server,
    clean_env,
    sandbox_pids,
    started_server,
    until,
)

CLI_TIMEOUT = 120
WATCHDOG = "0.001"  # seconds: shorter than any real phase (see the module docstring)
CAPACITY_TIMEOUT = 1
IDLE_TIMEOUT = 3  # the watch loop checks once a second


# -- processes ---------------------------------------------------------------------------
def _live_parents() -> dict[int, int]:
    """pid → parent pid of every process on the machine that is not a zombie."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            parents[int(entry.name)] = int(fields[1])
    return parents


def sandbox_processes(server: Server) -> set[int]:
    """Live processes in the server's sandbox cgroups or started by the serve process."""
    parents = _live_parents()
    found = sandbox_pids(server.data_dir) & parents.keys()
    if server.process is not None and server.process.poll() is None:
        frontier = {server.process.pid}
        while frontier:
            frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
            found |= frontier
    return found


def describe(pids: set[int]) -> str:
    lines = []
    for pid in sorted(pids):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        lines.append(f"{pid}: {command.decode(errors='replace')[:200]}")
    return "\n".join(lines)


def no_sandbox_process_left(server: Server) -> None:
    try:
        until(lambda: not sandbox_processes(server), "every sandbox process to be gone", 10)
    except AssertionError as error:
        raise AssertionError(f"{error}; left:\n{describe(sandbox_processes(server))}") from None


# -- the server, its chats and the CLI ---------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _bubblewrap_works(tmp_path_factory: pytest.TempPathFactory) -> None:
    from ivy_sandbox.backends.base import BackendError
    from ivy_sandbox.backends.local import LocalBackend

    try:
        LocalBackend(tmp_path_factory.mktemp("bwrap-check"))
    except BackendError as exc:
        pytest.skip(f"bubblewrap cannot run here: {exc.message}")


class Deployment:
    """A running ``serve`` on the local backend, one user with a key, and its chats."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.user = f"user_{uuid.uuid4().hex[:10]}"
        server.admin("users", "create", self.user)
        self.key = server.admin("keys", "create", "--user", self.user)
        self.chats: list[str] = []

    def new_chat(self) -> Account:
        chat = self.server.admin("chats", "create", "--user", self.user)
        self.chats.append(chat)
        return Account(self.user, chat, self.key)

    def cli(
        self, *args: str, stdin: str | None = None, what: str = ""
    ) -> subprocess.CompletedProcess[str]:
        """Run ``ivy-sandbox ARGS`` as a client of this server, on pipes (not a terminal)."""
        env = clean_env(
            self.server.data_dir, {"IVY_API_URL": self.server.base_url, "IVY_API_KEY": self.key}
        )
        return subprocess.run(
            [str(IVY), *args],
            env=env,
            input=stdin,
            stdin=subprocess.DEVNULL if stdin is None else None,
            capture_output=True,
            text=True,
            timeout=CLI_TIMEOUT,
            check=False,
        )

    def http(self, method: str, chat: str, suffix: str = "", **kwargs: Any) -> httpx.Response:
        url = f"{self.server.base_url}/v1/sandbox/{chat}{suffix}"
        headers = {"Authorization": f"Bearer {self.key}"}
        return httpx.request(method, url, headers=headers, timeout=60, **kwargs)

    def status(self, chat: str) -> dict[str, Any]:
        response = self.http("GET", chat, "/status")
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    def detail(self, chat: str) -> dict[str, Any]:
        response = self.http("GET", chat)
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    def launch_and_wait(self, chat: str) -> None:
        result = self.cli("launch", chat, "--wait")
        assert (result.returncode, result.stdout) == (0, "active\n"), (
            f"{result.stderr}\n{self.server.logs()}"
        )

    def shut_down(self) -> None:
        """Stop every chat's sandbox, then the server; kill and report anything left."""
        try:
            if self.server.process is not None and self.server.process.poll() is None:
                for chat in self.chats:
                    self.http("DELETE", chat)
        finally:
            self.server.stop()
            left = sandbox_processes(self.server)
            listing = describe(left)
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        assert not left, f"sandbox processes outlived the test:\n{listing}"


def deployment(tmp: Path, env: dict[str, str] | None = None) -> Deployment:
    return Deployment(started_server(tmp, {"IVY_SANDBOX_BACKEND": "local", **(env or {})}))


@pytest.fixture(scope="module")
def ivy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """One server for the happy path (its tests launch and stop their own chats)."""
    running = deployment(tmp_path_factory.mktemp("local-flow"))
    yield running
    running.shut_down()


@pytest.fixture
def active(ivy: Deployment) -> Iterator[Account]:
    """A chat whose sandbox was launched with ``ivy-sandbox launch --wait``; stopped after."""
    account = ivy.new_chat()
    ivy.launch_and_wait(account.chat)
    yield account
    ivy.http("DELETE", account.chat)


# -- the "done when" flow ----------------------------------------------------------------
def test_launch_wait_prints_active_and_exec_ls_workspace_then_works(ivy: Deployment) -> None:
    account = ivy.new_chat()
    try:
        launched = ivy.cli("launch", account.chat, "--wait")
        assert (launched.returncode, launched.stdout) == (0, "active\n"), launched.stderr
        assert ivy.status(account.chat)["status"] == "active"
        assert sandbox_processes(ivy.server), "an active sandbox runs real processes"

        listed = ivy.cli("exec", account.chat, "--", "ls", "/workspace")
        assert (listed.returncode, listed.stdout, listed.stderr) == (0, "", "")
    finally:
        ivy.http("DELETE", account.chat)


def test_a_file_written_through_exec_is_listed_in_the_workspace(
    ivy: Deployment, active: Account
) -> None:
    wrote = ivy.cli("exec", active.chat, "--", "sh", "-c", "echo hi > /workspace/f")
    assert (wrote.returncode, wrote.stdout, wrote.stderr) == (0, "", "")
    listed = ivy.cli("exec", active.chat, "--", "ls", "/workspace")
    assert (listed.returncode, listed.stdout) == (0, "f\n"), listed.stderr
    read = ivy.cli("exec", active.chat, "--", "cat", "/workspace/f")
    assert read.stdout == "hi\n"


def test_exec_exits_with_the_commands_exit_code_and_keeps_stdout_and_stderr_apart(
    ivy: Deployment, active: Account
) -> None:
    script = "echo to-stdout; echo to-stderr >&2; exit 5"
    result = ivy.cli("exec", active.chat, "--", "sh", "-c", script)
    assert (result.returncode, result.stdout, result.stderr) == (5, "to-stdout\n", "to-stderr\n")


def test_exec_passes_its_stdin_to_the_command(ivy: Deployment, active: Account) -> None:
    result = ivy.cli("exec", active.chat, "--", "sh", "-c", "tr a-z A-Z", stdin="piped in\n")
    assert (result.returncode, result.stdout, result.stderr) == (0, "PIPED IN\n", "")


def test_stop_prints_none_ends_the_sandbox_and_exec_afterwards_fails_with_409(
    ivy: Deployment, active: Account
) -> None:
    assert sandbox_processes(ivy.server)

    stopped = ivy.cli("stop", active.chat)
    assert (stopped.returncode, stopped.stdout, stopped.stderr) == (0, "none\n", "")
    assert ivy.status(active.chat) == {"status": "none"}
    no_sandbox_process_left(ivy.server)

    refused = ivy.cli("exec", active.chat, "--", "ls", "/workspace")
    assert (refused.returncode, refused.stdout) == (1, "")
    assert refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith("error: 409 conflict: "), refused.stderr
    assert "not active (status: none)" in refused.stderr


# -- failure paths -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("variable", "phase", "error_code", "cause"),
    [
        ("IVY_COMPUTE_TIMEOUT", "compute", "compute_timeout", "starting compute"),
        ("IVY_MOUNT_TIMEOUT", "mount", "mount_timeout", "mounting the workspace"),
        ("IVY_READY_TIMEOUT", "ready", "readiness_timeout", "the readiness probe"),
    ],
)
def test_a_phase_over_its_watchdog_fails_with_its_error_code_and_leaves_no_process(
    tmp_path: Path, variable: str, phase: str, error_code: str, cause: str
) -> None:
    ivy = deployment(tmp_path, {variable: WATCHDOG})
    try:
        account = ivy.new_chat()
        message = f"{phase}: {cause} did not finish within {float(WATCHDOG):g} s"

        launched = ivy.cli("launch", account.chat, "--wait")
        assert (launched.returncode, launched.stdout) == (1, ""), launched.stderr
        assert launched.stderr.splitlines()[-1] == f"error: {error_code}: {message}"

        status = ivy.status(account.chat)
        assert (status["status"], status["errorMessage"]) == ("failed", message)
        detail = ivy.detail(account.chat)
        assert (detail["status"], detail["errorCode"]) == ("failed", error_code)
        reached = [entry["phase"] for entry in detail["phases"]]
        assert reached[-1] == phase, detail
        no_sandbox_process_left(ivy.server)
        assert not any((ivy.server.data_dir / "sandboxes").glob("*")), "bookkeeping left"
    finally:
        ivy.shut_down()


def test_a_sandbox_that_cannot_start_fails_with_compute_failed_and_leaves_no_process(
    tmp_path: Path,
) -> None:
    """A real start failure: the chat's workspace path is taken by a plain file (say, an
    operator's mistake), so the sandbox cannot be set up around it."""
    ivy = deployment(tmp_path)
    try:
        account = ivy.new_chat()
        workspaces = ivy.server.data_dir / "workspaces"
        workspaces.mkdir(parents=True, exist_ok=True)
        (workspaces / account.chat).write_text("not a directory")

        launched = ivy.cli("launch", account.chat, "--wait")
        assert (launched.returncode, launched.stdout) == (1, ""), launched.stderr
        assert launched.stderr.splitlines()[-1].startswith("error: compute_failed: compute: ")
        detail = ivy.detail(account.chat)
        assert (detail["status"], detail["errorCode"]) == ("failed", "compute_failed")
        assert detail["errorMessage"].startswith("compute: ")
        no_sandbox_process_left(ivy.server)
        assert (workspaces / account.chat).read_text() == "not a directory"  # left alone
    finally:
        ivy.shut_down()


def test_a_launch_over_capacity_fails_with_capacity_timeout_and_the_active_one_keeps_running(
    tmp_path: Path,
) -> None:
    env = {"IVY_MAX_SANDBOXES": "1", "IVY_CAPACITY_TIMEOUT": str(CAPACITY_TIMEOUT)}
    ivy = deployment(tmp_path, env)
    try:
        first, second = ivy.new_chat(), ivy.new_chat()
        ivy.launch_and_wait(first.chat)
        running = sandbox_processes(ivy.server)
        assert running

        launched = ivy.cli("launch", second.chat, "--wait")
        assert (launched.returncode, launched.stdout) == (1, ""), launched.stderr
        expected = (
            f"compute: no sandbox capacity became free within {CAPACITY_TIMEOUT} s "
            "(IVY_MAX_SANDBOXES=1)"
        )
        assert launched.stderr.splitlines()[-1] == f"error: capacity_timeout: {expected}"
        status = ivy.status(second.chat)
        assert (status["status"], status["errorMessage"]) == ("failed", expected)
        detail = ivy.detail(second.chat)
        assert detail["errorCode"] == "capacity_timeout"
        assert "waiting" not in detail  # no longer queued

        assert sandbox_processes(ivy.server) == running  # nothing started for the second
        ran = ivy.cli("exec", first.chat, "--", "true")
        assert ran.returncode == 0, ran.stderr
        assert ivy.status(first.chat)["status"] == "active"
    finally:
        ivy.shut_down()


# -- idle reaping --------------------------------------------------------------------------
def test_an_idle_sandbox_is_stopped_and_its_workspace_kept_for_the_next_launch(
    tmp_path: Path,
) -> None:
    ivy = deployment(tmp_path, {"IVY_SANDBOX_IDLE_TIMEOUT": str(IDLE_TIMEOUT)})
    try:
        account = ivy.new_chat()
        ivy.launch_and_wait(account.chat)
        wrote = ivy.cli("exec", account.chat, "--", "sh", "-c", "echo kept > /workspace/note")
        assert wrote.returncode == 0, wrote.stderr
        assert sandbox_processes(ivy.server)

        until(lambda: ivy.status(account.chat) == {"status": "none"}, "idle reaping")
        no_sandbox_process_left(ivy.server)
        workspace = ivy.server.data_dir / "workspaces" / account.chat
        assert (workspace / "note").read_text() == "kept\n"

        # Relaunch over HTTP and read at once: the CLI's start-up would eat into the idle
        # timeout, and this sandbox is reaped too once it has idled that long.
        assert ivy.http("POST", account.chat).status_code == 202
        until(lambda: ivy.status(account.chat)["status"] == "active", "the relaunch")
        read = ivy.http("POST", account.chat, "/exec", json={"command": ["cat", "/workspace/note"]})
        assert (read.status_code, read.json()["stdout"]) == (200, "kept\n"), read.text
    finally:
        ivy.shut_down()

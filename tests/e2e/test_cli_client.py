"""``ivy-sandbox status --follow`` and ``launch --wait`` against a real ``ivy-sandbox serve``.

The server runs the ``latency-fake`` backend (phases of about 1.5, 0.8 and 0.4 s; nothing
runs) with room for one sandbox and a capacity timeout of CAPACITY_TIMEOUT seconds: a launch
queued behind another (admitted first) fails with ``capacity_timeout`` — a real failure
path, reached without any test hook. The timeout leaves a CLI started after the launch
(a new Python process: about half a second, more on a loaded CI machine) ample time to
see the launch queued before it fails. Each test stops its sandboxes when it ends, so the
next one finds the slot free.

"On a terminal" means a real pseudo-terminal (``pty``); "not a terminal" means a pipe.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from serve_process import IVY, Account, Server, clean_env, started_server

from ivy_sandbox.client import Client

PHASES = [
    ("provisioning", "compute"),
    ("provisioning", "mount"),
    ("provisioning", "ready"),
    ("active", "ready"),
]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
TIMEOUT = 40


CHATS = 14  # the tests below use 12
CAPACITY_TIMEOUT = 5


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    env = {
        "IVY_SANDBOX_BACKEND": "latency-fake",
        "IVY_MAX_SANDBOXES": "1",
        "IVY_CAPACITY_TIMEOUT": str(CAPACITY_TIMEOUT),
    }
    server = started_server(tmp_path_factory.mktemp("cli-client"), env)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def chats(server: Server) -> list[Account]:
    """One user and key (admin CLI), and a chat for every test (``POST /v1/chats``)."""
    user = f"user_{uuid.uuid4().hex[:10]}"
    server.admin("users", "create", user)
    key = server.admin("keys", "create", "--user", user)
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=server.base_url, headers=headers) as http:
        made = [http.post("/v1/chats") for _ in range(CHATS)]
    assert {response.status_code for response in made} == {201}
    return [Account(user, response.json()["id"], key) for response in made]


@pytest.fixture
def accounts(server: Server, chats: list[Account]) -> Iterator[Callable[[], Account]]:
    """Hands out fresh chats; their sandboxes are stopped when the test ends."""
    used: list[Account] = []

    def take() -> Account:
        used.append(chats.pop())
        return used[-1]

    yield take
    for account in used:
        with Client(server.base_url, account.key) as ivy:
            ivy.sandbox.stop(account.chat)


@pytest.fixture
def account(accounts: Callable[[], Account]) -> Account:
    return accounts()


def client_env(server: Server, account: Account, **extra: str) -> dict[str, str]:
    return clean_env(
        server.data_dir,
        {"IVY_API_URL": server.base_url, "IVY_API_KEY": account.key, **extra},
    )


def cli(server: Server, account: Account, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI with stdout and stderr on pipes (not a terminal)."""
    return subprocess.run(
        [str(IVY), *args],
        env=client_env(server, account),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


def in_terminal(server: Server, account: Account, *args: str) -> tuple[int, str]:
    """Run the CLI on a 100x24 pseudo-terminal; its exit code and everything it drew."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    env = client_env(server, account, TERM="xterm-256color", COLUMNS="100", LINES="24")
    for name in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        env.pop(name, None)
    process = subprocess.Popen(
        [str(IVY), *args], env=env, stdin=follower, stdout=follower, stderr=follower
    )
    os.close(follower)
    output = bytearray()
    deadline = time.monotonic() + TIMEOUT
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.5)
            if not ready:
                if process.poll() is not None:
                    break
                continue
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: the terminal's other side is closed
                break
            if not data:
                break
            output += data
        else:
            process.kill()
            pytest.fail(
                f"{args} did not end within {TIMEOUT} s:\n{output.decode(errors='replace')}"
            )
    finally:
        os.close(leader)
    return process.wait(timeout=10), output.decode(errors="replace")


def final_frame(drawn: str) -> str:
    """The last frame of a live display (rich redraws after moving the cursor up), as text."""
    return ANSI.sub("", drawn.rsplit("\x1b[1A", 1)[-1]).replace("\r", "")


def launch(server: Server, account: Account) -> None:
    with Client(server.base_url, account.key) as ivy:
        ivy.sandbox.launch(account.chat)


def launch_queued_behind_another(server: Server, accounts: Callable[[], Account]) -> Account:
    """A chat whose launch waits for the only slot, taken by another chat's launch: it fails
    with capacity_timeout after CAPACITY_TIMEOUT seconds. Returns the waiting chat."""
    blocker, victim = accounts(), accounts()
    launch(server, blocker)  # first come, first served: this one is admitted
    launch(server, victim)
    return victim


# -- status --follow, not on a terminal ------------------------------------------------------
def test_follow_without_a_terminal_prints_each_change_as_a_json_line_and_exits_0_on_active(
    server: Server, account: Account
) -> None:
    launch(server, account)
    result = cli(server, account, "status", account.chat, "--follow")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    bodies = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(b["status"], b.get("phase")) for b in bodies] == PHASES
    assert all(set(b) <= {"status", "phase", "etaSeconds", "createdAt"} for b in bodies)
    assert all("etaSeconds" in b for b in bodies[:-1])  # an estimate while provisioning


def test_follow_of_a_failing_launch_ends_with_the_failed_body_and_exits_1_with_the_error(
    server: Server, accounts: Callable[[], Account]
) -> None:
    victim = launch_queued_behind_another(server, accounts)
    result = cli(server, victim, "status", victim.chat, "--follow")
    assert result.returncode == 1
    bodies = [json.loads(line) for line in result.stdout.splitlines()]
    assert (bodies[0]["status"], bodies[0]["phase"]) == ("provisioning", "compute")
    assert "etaSeconds" not in bodies[0]  # queued for capacity: no estimate
    assert bodies[-1]["status"] == "failed"
    assert bodies[-1]["errorMessage"].startswith("compute: ")
    assert result.stderr.startswith("error: capacity_timeout: compute: ")
    assert result.stderr.count("\n") == 1


def test_follow_of_a_chat_without_sandbox_prints_none_and_exits_3(
    server: Server, account: Account
) -> None:
    result = cli(server, account, "status", account.chat, "--follow")
    assert (result.returncode, result.stdout) == (3, '{"status":"none"}\n')
    assert "has no sandbox" in result.stderr


def test_status_without_follow_still_prints_only_the_value(
    server: Server, account: Account
) -> None:
    assert cli(server, account, "status", account.chat).stdout == "none\n"
    assert cli(server, account, "status", account.chat, "--json").stdout == '{"status":"none"}\n'


# -- status --follow, on a terminal ----------------------------------------------------------
def test_follow_on_a_terminal_draws_phases_elapsed_and_eta_live_and_ends_on_active(
    server: Server, account: Account
) -> None:
    launch(server, account)
    code, drawn = in_terminal(server, account, "status", account.chat, "--follow")
    assert code == 0, drawn
    text = ANSI.sub("", drawn)
    assert drawn.count("\x1b[1A") >= 10  # redrawn in place, many times
    for phase in ("compute", "mount", "ready"):
        assert f"provisioning · {phase}" in text
    assert re.search(r"\d+\.\d s elapsed  ·  ETA \d+ s", text)
    final = final_frame(drawn)
    assert "✔ active" in final
    assert "compute ✓ → mount ✓ → ready ✓" in final
    assert "{" not in text  # no JSON on a terminal


def test_follow_on_a_terminal_shows_the_failure_and_exits_1(
    server: Server, accounts: Callable[[], Account]
) -> None:
    victim = launch_queued_behind_another(server, accounts)
    code, drawn = in_terminal(server, victim, "status", victim.chat, "--follow")
    assert code == 1, drawn
    text = ANSI.sub("", drawn)
    assert "ETA unknown (queued)" in text  # queued for capacity: no estimate
    assert "✖ failed during compute" in text
    assert "(capacity_timeout)" in text
    assert "error: capacity_timeout: compute: " in text  # the one error line, after the display


# -- launch --wait ---------------------------------------------------------------------------
def test_launch_wait_without_a_terminal_prints_only_active_and_progress_on_stderr(
    server: Server, account: Account
) -> None:
    result = cli(server, account, "launch", account.chat, "--wait")
    assert (result.returncode, result.stdout) == (0, "active\n"), result.stderr
    lines = result.stderr.splitlines()
    assert [tuple(line.split()[:2]) for line in lines] == PHASES
    assert re.fullmatch(r"provisioning compute ~\d+ s", lines[0])


def test_launch_wait_on_a_terminal_uses_the_live_display_then_prints_active(
    server: Server, account: Account
) -> None:
    code, drawn = in_terminal(server, account, "launch", account.chat, "--wait")
    assert code == 0, drawn
    text = ANSI.sub("", drawn)
    assert "provisioning · compute" in text
    assert "✔ active" in text
    assert text.replace("\r", "").rstrip().endswith("\nactive")  # the value, last


def test_launch_wait_exits_1_with_one_error_line_when_the_launch_fails(
    server: Server, accounts: Callable[[], Account]
) -> None:
    blocker, victim = accounts(), accounts()
    launch(server, blocker)
    result = cli(server, victim, "launch", victim.chat, "--wait", "--json")
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.splitlines()[-1].startswith("error: capacity_timeout: compute: ")


def test_the_cli_reads_url_and_key_from_the_environment(tmp_path: Path) -> None:
    env = clean_env(tmp_path, {"IVY_API_URL": "http://127.0.0.1:9"})
    result = subprocess.run(
        [str(IVY), "status", "chat_x", "--follow"],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert (result.returncode, result.stdout) == (2, "")
    assert "IVY_API_KEY" in result.stderr

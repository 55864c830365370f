"""LocalBackend against real bubblewrap: the round trip, isolation, limits, exec semantics,
surviving a control-plane SIGKILL, and clean-up.

Skipped (or failed, with IVY_TEST_REQUIRE_SERVICES=1) only where bwrap cannot run at all.
Every test's data dir is a fresh tmp dir; the ``backend`` fixture stops whatever is left in
it and checks that no cgroup of those sandboxes survives.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import service_unavailable
from ivy_sandbox.backends import cgroups
from ivy_sandbox.backends.base import (
    BackendError,
    BackendState,
    ErrorCode,
    ExecRequest,
    Liveness,
    ResourceLimits,
    SandboxSpec,
)
from ivy_sandbox.backends.local import LocalBackend

MB = 1024 * 1024
ROOT = os.geteuid() == 0
CGROUP_V1 = Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists()

pytestmark = pytest.mark.both_loops  # serve runs on uvloop; tests default to asyncio


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[LocalBackend]:
    try:
        local = LocalBackend(tmp_path / "data")
    except BackendError as exc:
        service_unavailable(f"bubblewrap cannot run here: {exc.message}")
    yield local
    for state in (await local.list_sandboxes()).values():
        await local.stop(state)
    await local.aclose()
    assert not cgroups_named(f"{local._cgroup_prefix}*")  # no cgroup (so no process) leaked


Launch = Callable[..., Awaitable[tuple[SandboxSpec, BackendState]]]


@pytest.fixture
def launch(backend: LocalBackend) -> Launch:
    """start → mount → probe, as the engine drives it; returns (spec, state)."""
    counter = iter(range(1000))

    async def go(chat: str = "chat_a", **spec: Any) -> tuple[SandboxSpec, BackendState]:
        made = SandboxSpec(sandbox_id=f"sbx_{chat}_{next(counter)}", chat_id=chat, **spec)
        state = await backend.start(made)
        state = await backend.mount(made, state)
        assert await backend.probe(made, state)
        return made, state

    return go


async def sh(backend: LocalBackend, state: BackendState, script: str, **request: Any) -> Any:
    return await backend.exec(state, ExecRequest(["/bin/sh", "-c", script], **request))


def existing(paths: Any) -> list[str]:
    """Which of ``paths`` exist (a sync helper: tests are async, these are tiny reads)."""
    return [str(path) for path in paths if Path(path).exists()]


def read(path: str | Path) -> str:
    return Path(path).read_text()


def reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def alive(pid: int) -> bool:
    """True for a live process; a zombie (already dead, waiting for its reaper) is not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def cgroup_file(state: BackendState, controller: str, name: str) -> str:
    for group in state["cgroups"]:
        if controller in group["controllers"]:
            return (Path(group["path"]) / name).read_text().strip()
    pytest.skip(f"no {controller} cgroup on this machine")


# -- the round trip -----------------------------------------------------------------------------
async def test_round_trip_runs_commands_with_stdin_env_cwd_and_exit_codes(
    backend: LocalBackend, launch: Launch, tmp_path: Path
) -> None:
    _, state = await launch()
    (tmp_path / "data" / "workspaces" / "chat_a" / "hello.txt").write_text("hi")

    listed = await backend.exec(state, ExecRequest(["ls", "/workspace"]))
    assert (listed.exit_code, listed.stdout, listed.timed_out) == (0, b"hello.txt\n", False)
    echoed = await backend.exec(state, ExecRequest(["cat"], stdin=b"via stdin\n"))
    assert echoed.stdout == b"via stdin\n"
    env = await sh(backend, state, 'echo "$FOO|$HOME|$PATH"; env | wc -l', env={"FOO": "bar"})
    home_path = b"bar|/home/sandbox|/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    assert env.stdout.splitlines()[0] == home_path
    assert int(env.stdout.splitlines()[1]) <= 7  # PATH HOME LANG USER FOO (+PWD, SHLVL): clean
    assert (await backend.exec(state, ExecRequest(["pwd"], cwd="/tmp"))).stdout == b"/tmp\n"
    assert (await backend.exec(state, ExecRequest(["pwd"]))).stdout == b"/workspace\n"
    assert (await sh(backend, state, "echo oops >&2; exit 3")).exit_code == 3
    assert (await sh(backend, state, "echo oops >&2; exit 3")).stderr == b"oops\n"
    assert (await sh(backend, state, "kill -TERM $$")).exit_code == 128 + signal.SIGTERM
    assert (await sh(backend, state, "kill -KILL $$")).exit_code == 137
    assert (await backend.exec(state, ExecRequest(["no-such-program"]))).exit_code == 127
    private = await sh(backend, state, "touch ~/.profile /tmp/scratch && stat -c '%a %U' ~ /tmp")
    assert private.stdout == b"700 sandbox\n1777 sandbox\n"


async def test_state_is_json_and_names_pids_cgroups_workspace_and_bookkeeping(
    launch: Launch, tmp_path: Path
) -> None:
    _, state = await launch()
    assert json.loads(json.dumps(state)) == state
    assert state["workspace"] == str(tmp_path / "data" / "workspaces" / "chat_a")
    assert existing([Path(state["bookkeeping"], "state.json")])
    for role in ("outer", "init", "command"):
        assert alive(state["pids"][role]["pid"])
        assert isinstance(state["pids"][role]["start"], int)
    assert len(existing(group["path"] for group in state["cgroups"])) == len(state["cgroups"])


async def test_mount_rejects_a_state_of_another_chat(backend: LocalBackend, launch: Launch) -> None:
    _, state = await launch("chat_a")
    with pytest.raises(BackendError) as caught:
        await backend.mount(SandboxSpec(sandbox_id="sbx_x", chat_id="chat_b"), state)
    assert caught.value.code is ErrorCode.MOUNT_FAILED


@pytest.mark.skipif(not ROOT, reason="only root can choose the sandbox's host uid")
async def test_sandbox_processes_are_an_unprivileged_host_uid_without_capabilities(
    backend: LocalBackend, launch: Launch, tmp_path: Path
) -> None:
    _, state = await launch()
    await sh(backend, state, "touch /workspace/made-inside")
    assert (tmp_path / "data/workspaces/chat_a/made-inside").stat().st_uid == 65534
    workspace = tmp_path / "data/workspaces/chat_a"
    assert (workspace.stat().st_uid, workspace.stat().st_mode & 0o777) == (65534, 0o700)
    for role in ("outer", "init", "command"):
        status = read(f"/proc/{state['pids'][role]['pid']}/status")
        assert "Uid:\t65534\t65534\t65534\t65534" in status
        assert "CapEff:\t0000000000000000" in status
    query = "grep -E '^(Uid|Groups|CapEff|CapPrm|NoNewPrivs)' /proc/self/status"
    own_groups = os.getgroups()
    os.setgroups([4, 27])  # a control plane with supplementary groups: none may come along
    try:
        inside = await sh(backend, state, query)
    finally:
        os.setgroups(own_groups)
    assert b"CapEff:\t0000000000000000" in inside.stdout
    assert b"NoNewPrivs:\t1" in inside.stdout
    groups = [line.split()[1:] for line in inside.stdout.splitlines() if b"Groups:" in line]
    assert groups == [[]]  # none of root's supplementary groups came along
    nested = await backend.exec(state, ExecRequest(["unshare", "--user", "true"]))
    assert nested.exit_code != 0  # --disable-userns: no user namespaces inside


# -- isolation ------------------------------------------------------------------------------------
async def test_workspace_persists_across_stop_and_start_for_the_same_chat(
    backend: LocalBackend, launch: Launch
) -> None:
    _, first = await launch("chat_a")
    await sh(backend, first, "echo kept > /workspace/notes.txt; echo gone > /tmp/scratch")
    await backend.stop(first)
    _, second = await launch("chat_a")
    assert (await backend.exec(second, ExecRequest(["cat", "/workspace/notes.txt"]))).stdout == (
        b"kept\n"
    )
    assert (await backend.exec(second, ExecRequest(["ls", "/tmp"]))).stdout == b""


async def test_another_chats_workspace_is_not_reachable_from_a_sandbox(
    backend: LocalBackend, launch: Launch, tmp_path: Path
) -> None:
    _, a = await launch("chat_a")
    await sh(backend, a, "echo secret-of-a > /workspace/secret-of-a.txt")
    _, b = await launch("chat_b")
    host_a = tmp_path / "data" / "workspaces" / "chat_a"
    script = f"""
        for p in {host_a} {host_a}/secret-of-a.txt /proc/1/root{host_a} /proc/*/root{host_a} \
                 /proc/*/cwd/../chat_a /workspace/../chat_a /workspace/../../workspaces; do
            [ -e "$p" ] && echo "REACHED $p"
        done
        find / -xdev -name 'secret-of-a*' 2>/dev/null | sed 's/^/FOUND /'
        grep -rs secret-of-a /workspace /tmp /home /proc/*/root/workspace | sed 's/^/READ /'
        ls /workspace/..
        true
    """
    result = await sh(backend, b, textwrap.dedent(script))
    assert result.exit_code == 0
    assert b"REACHED" not in result.stdout
    assert b"FOUND" not in result.stdout
    assert b"READ" not in result.stdout
    assert b"secret-of-a" not in result.stdout


async def test_no_descriptor_inside_points_at_the_host_data_dir(
    backend: LocalBackend, launch: Launch, tmp_path: Path
) -> None:
    """An inherited directory fd would be a way out (openat(fd, "..")); none may leak."""
    _, state = await launch()
    links = await sh(backend, state, "for f in /proc/[0-9]*/fd/*; do readlink $f; done")
    assert str(tmp_path).encode() not in links.stdout
    assert b"/sys/fs/cgroup" not in links.stdout


async def test_a_sandbox_sees_only_its_own_processes(backend: LocalBackend, launch: Launch) -> None:
    _, state = await launch()
    result = await sh(backend, state, "ls /proc | grep -c '^[0-9]'; cat /proc/[0-9]*/comm")
    count, *names = result.stdout.decode().split()
    assert int(count) <= 5  # pid 1 (bwrap), sleep, this sh, ls/grep/cat
    assert set(names) <= {"bwrap", "sleep", "sh", "cat"}
    first = await backend.exec(state, ExecRequest(["cat", "/proc/1/comm", "/proc/2/cmdline"]))
    assert first.stdout == b"bwrap\nsleep\x00infinity\x00"


async def test_no_network_by_default_but_an_isolated_loopback(
    backend: LocalBackend, launch: Launch
) -> None:
    server = await asyncio.start_server(lambda _, writer: writer.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        _, state = await launch()
        outside = f"import socket; socket.create_connection(('127.0.0.1', {port}), 2)"
        blocked = await backend.exec(state, ExecRequest(["python3", "-c", outside]))
        assert blocked.exit_code != 0
        assert b"ConnectionRefused" in blocked.stderr
        loopback = (
            "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen();"
            "socket.create_connection(s.getsockname(), 2); print('loopback ok')"
        )
        inside = await backend.exec(state, ExecRequest(["python3", "-c", loopback]))
        assert inside.stdout == b"loopback ok\n"
        devices = await backend.exec(state, ExecRequest(["cat", "/proc/net/dev"]))
        assert devices.stdout.count(b":") == 1  # only lo
    finally:
        server.close()


async def test_network_is_shared_when_the_spec_asks_for_it(
    backend: LocalBackend, launch: Launch
) -> None:
    accepted = asyncio.Event()

    def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set()
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        _, state = await launch(network=True)
        code = f"import socket; socket.create_connection(('127.0.0.1', {port}), 2); print('ok')"
        result = await backend.exec(state, ExecRequest(["python3", "-c", code]))
        assert (result.exit_code, result.stdout) == (0, b"ok\n")
        await asyncio.wait_for(accepted.wait(), 2)
        resolv = await backend.exec(state, ExecRequest(["test", "-e", "/etc/resolv.conf"]))
        assert resolv.exit_code == 0
    finally:
        server.close()


async def test_usr_is_read_only(backend: LocalBackend, launch: Launch) -> None:
    _, state = await launch()
    for script in ("touch /usr/evil", "echo x > /usr/bin/evil", "rm -f /usr/bin/env"):
        result = await sh(backend, state, script)
        assert result.exit_code != 0, script
    assert existing(["/usr/evil", "/usr/bin/env"]) == ["/usr/bin/env"]


# -- limits -------------------------------------------------------------------------------------
async def test_enforced_limits_report_the_cgroup_version_of_this_machine(
    backend: LocalBackend,
) -> None:
    limits = backend.enforced_limits()
    if CGROUP_V1:  # as on our development VMs
        assert (limits.memory, limits.pids, limits.cpu) == ("cgroup v1",) * 3
    else:
        assert limits.memory in ("cgroup v2", "rlimit (RLIMIT_AS, per process)")


async def test_limits_are_written_to_the_sandbox_cgroups(launch: Launch) -> None:
    _, state = await launch(limits=ResourceLimits(memory_bytes=64 * MB, pids=32, cpus=0.5))
    if CGROUP_V1:
        assert cgroup_file(state, "memory", "memory.limit_in_bytes") == str(64 * MB)
        assert cgroup_file(state, "pids", "pids.max") == "32"
        assert cgroup_file(state, "cpu", "cpu.cfs_quota_us") == "50000"
    else:
        assert cgroup_file(state, "memory", "memory.max") == str(64 * MB)
        assert cgroup_file(state, "pids", "pids.max") == "32"


async def test_a_fork_bomb_is_contained_by_the_pids_limit(
    backend: LocalBackend, launch: Launch
) -> None:
    _, state = await launch(limits=ResourceLimits(memory_bytes=256 * MB, pids=48, cpus=1.0))
    # `exec sleep`: once the bomb runs, even the shell could not fork a plain `sleep`.
    bomb = await sh(backend, state, "b() { b | b & }; b; exec sleep 60", timeout_seconds=2)
    assert bomb.timed_out
    assert bomb.exit_code == 137
    assert "max 0" not in cgroup_file(state, "pids", "pids.events")  # the limit was hit
    assert int(cgroup_file(state, "pids", "pids.current")) <= 4  # the bomb is gone
    host = await asyncio.create_subprocess_exec("true")
    assert await host.wait() == 0  # the host still forks
    assert (await backend.exec(state, ExecRequest(["echo", "fine"]))).stdout == b"fine\n"
    await backend.stop(state)
    assert (await backend.inspect(state)).liveness is Liveness.GONE


async def test_a_memory_hog_is_oom_killed_and_the_host_survives(
    backend: LocalBackend, launch: Launch
) -> None:
    _, state = await launch(limits=ResourceLimits(memory_bytes=64 * MB, pids=64, cpus=1.0))
    hog = ["python3", "-c", "b = bytearray(256 * 1024 * 1024); print('survived')"]
    result = await backend.exec(state, ExecRequest(hog))
    assert result.exit_code != 0
    assert result.exit_code == 137  # SIGKILL from the OOM killer
    assert b"survived" not in result.stdout
    assert (await backend.inspect(state)).liveness is Liveness.RUNNING
    assert (await backend.exec(state, ExecRequest(["echo", "fine"]))).stdout == b"fine\n"


# -- exec semantics -----------------------------------------------------------------------------
async def test_exec_timeout_kills_the_whole_tree_including_setsid_grandchildren(
    backend: LocalBackend, launch: Launch, tmp_path: Path
) -> None:
    _, state = await launch()
    escapee = """
        setsid sh -c 'echo $$ > /workspace/escapee.pid; exec sleep 300' &
        ( setsid sh -c 'echo $$ > /workspace/double.pid; exec sleep 301' & ) &
        sleep 302
    """
    started = time.monotonic()
    result = await sh(backend, state, textwrap.dedent(escapee), timeout_seconds=1)
    assert (result.exit_code, result.timed_out) == (137, True)
    assert time.monotonic() - started < 5
    workspace = tmp_path / "data" / "workspaces" / "chat_a"
    for name in ("escapee.pid", "double.pid"):
        pid = (workspace / name).read_text().strip()
        check = await sh(backend, state, f"kill -0 {pid} 2>/dev/null && echo ALIVE || echo gone")
        assert check.stdout == b"gone\n", name
    left = await sh(backend, state, "ps -eo args | grep -c '[s]leep 30'")
    assert left.stdout == b"0\n"
    zombies = await sh(backend, state, "ps -eo stat | grep -c '^Z'")
    assert zombies.stdout == b"0\n"  # nothing killed was left for the host's init to reap


async def test_output_cap_sets_truncated_and_keeps_draining(
    backend: LocalBackend, launch: Launch
) -> None:
    _, state = await launch()
    flood = "head -c 5000000 /dev/zero; head -c 300000 /dev/zero >&2; echo done >&2"
    result = await sh(backend, state, flood, output_limit_bytes=1000, timeout_seconds=20)
    assert (result.exit_code, result.timed_out, result.truncated) == (0, False, True)
    assert len(result.stdout) == 1000
    assert len(result.stderr) == 1000
    small = await backend.exec(state, ExecRequest(["echo", "x"], output_limit_bytes=1000))
    assert not small.truncated


async def test_stdin_larger_than_a_pipe_arrives_whole_and_unread_stdin_does_not_hang(
    backend: LocalBackend, launch: Launch
) -> None:
    _, state = await launch()
    payload = os.urandom(3_000_000)  # many pipe buffers: fed while the command reads
    digest = await backend.exec(state, ExecRequest(["sha256sum"], stdin=payload))
    assert digest.stdout.split()[0].decode() == hashlib.sha256(payload).hexdigest()
    ignored = await sh(backend, state, "echo ignored", stdin=payload, timeout_seconds=20)
    assert (ignored.exit_code, ignored.stdout, ignored.timed_out) == (0, b"ignored\n", False)


async def test_execs_leave_no_descriptor_or_child_behind_in_the_control_plane(
    backend: LocalBackend, launch: Launch
) -> None:
    """Ordinary, timed-out and cancelled execs: the control plane's open fds and children
    are what they were before (each exec opens pipes and a pidfd of its own)."""
    _, state = await launch()
    await backend.exec(state, ExecRequest(["true"]))  # warm: lazily opened things
    before = sorted(os.listdir("/proc/self/fd"))
    for _ in range(5):
        await backend.exec(state, ExecRequest(["cat"], stdin=b"x" * 100_000))
        await sh(backend, state, "sleep 30", timeout_seconds=0.2)
        task = asyncio.create_task(sh(backend, state, "sleep 30"))
        await asyncio.sleep(0.2)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await asyncio.sleep(0.1)
    assert sorted(os.listdir("/proc/self/fd")) == before
    zombies = [pid for pid in cgroups.descendants(os.getpid()) if not alive(pid)]
    assert zombies == []


async def test_exec_in_a_stopped_sandbox_raises_sandbox_exited(
    backend: LocalBackend, launch: Launch
) -> None:
    _, state = await launch()
    await backend.stop(state)
    with pytest.raises(BackendError) as caught:
        await backend.exec(state, ExecRequest(["true"]))
    assert caught.value.code is ErrorCode.SANDBOX_EXITED


# -- surviving the control plane, inspect, stop, list ---------------------------------------
CONTROL_PLANE = """
import asyncio, json, sys
from pathlib import Path
from ivy_sandbox.backends.base import SandboxSpec
from ivy_sandbox.backends.local import LocalBackend

async def main():
    backend = LocalBackend(Path(sys.argv[1]))
    spec = SandboxSpec(sandbox_id="sbx_survivor", chat_id="chat_s")
    state = await backend.mount(spec, await backend.start(spec))
    print(json.dumps(state), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def cgroups_named(name: str) -> list[Path]:
    return list(Path("/sys/fs/cgroup").glob(f"**/{name}"))


def become_subreaper(on: bool) -> None:
    """Adopt orphans (as a real init would reap them; this VM's pid 1 is lazy about it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(36, int(on), 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER


async def test_a_sandbox_survives_a_sigkilled_control_plane_and_is_adopted_and_stopped(
    backend: LocalBackend, tmp_path: Path
) -> None:
    become_subreaper(True)
    try:
        plane = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CONTROL_PLANE, str(tmp_path / "data"), stdout=subprocess.PIPE
        )
        assert plane.stdout is not None
        line = await asyncio.wait_for(plane.stdout.readline(), 20)
        state = json.loads(line)
        plane.kill()
        await plane.wait()

        pids = [state["pids"][role]["pid"] for role in ("outer", "init", "command")]
        assert all(alive(pid) for pid in pids)
        assert (await backend.inspect(state)).liveness is Liveness.RUNNING
        assert "sbx_survivor" in await backend.list_sandboxes()
        hello = await backend.exec(state, ExecRequest(["echo", "adopted"]))
        assert hello.stdout == b"adopted\n"

        await backend.stop(state)
        assert not any(alive(pid) for pid in pids)
        assert not existing(group["path"] for group in state["cgroups"])
        assert not existing([state["bookkeeping"]])
        assert (tmp_path / "data" / "workspaces" / "chat_s").is_dir()
        assert (await backend.inspect(state)).liveness is Liveness.GONE
    finally:
        become_subreaper(False)
        reap(state["pids"]["outer"]["pid"])  # the outer bwrap we adopted as subreaper


async def test_inspect_reports_exited_with_the_status_after_pid_1_is_killed(
    backend: LocalBackend, launch: Launch
) -> None:
    _, state = await launch()
    os.kill(state["pids"]["init"]["pid"], signal.SIGKILL)
    for _ in range(200):
        inspection = await backend.inspect(state)
        if inspection.liveness is not Liveness.RUNNING and inspection.exit_status is not None:
            break
        await asyncio.sleep(0.01)
    assert inspection.liveness is Liveness.EXITED
    assert inspection.exit_status == 137
    last = read(Path(state["bookkeeping"], "status.json")).splitlines()[-1]
    assert json.loads(last) == {"exit-code": 137}
    await backend.stop(state)
    assert (await backend.inspect(state)).liveness is Liveness.GONE


def pidfds() -> int:
    """How many pidfds this process holds."""
    count = 0
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            count += os.readlink(fd) == "anon_inode:[pidfd]"
    return count


async def test_inspect_notices_a_watched_first_process_exiting(
    backend: LocalBackend, launch: Launch
) -> None:
    """After a first inspection the first process is watched through a pidfd; its exit
    must still turn the next inspection away from RUNNING (and release the pidfd)."""
    _, state = await launch()
    held = pidfds()
    assert (await backend.inspect(state)).liveness is Liveness.RUNNING
    assert (await backend.inspect(state)).liveness is Liveness.RUNNING
    assert pidfds() == held + 1
    os.kill(state["pids"]["command"]["pid"], signal.SIGKILL)
    for _ in range(200):
        inspection = await backend.inspect(state)
        if inspection.liveness is not Liveness.RUNNING:
            break
        await asyncio.sleep(0.01)
    assert inspection.liveness is not Liveness.RUNNING
    assert pidfds() == held
    await backend.stop(state)


async def test_stop_and_aclose_release_the_liveness_watch(tmp_path: Path) -> None:
    before = pidfds()
    try:
        local = LocalBackend(tmp_path / "data")
    except BackendError as exc:
        service_unavailable(f"bubblewrap cannot run here: {exc.message}")
    states = []
    try:
        for number in range(2):
            spec = SandboxSpec(sandbox_id=f"sbx_watch_{number}", chat_id=f"chat_w{number}")
            states.append(await local.start(spec))
            assert (await local.inspect(states[-1])).liveness is Liveness.RUNNING
        assert pidfds() == before + 2
        await local.stop(states[0])
        assert (await local.inspect(states[0])).liveness is Liveness.GONE
        assert pidfds() == before + 1
        await local.aclose()
        assert pidfds() == before
    finally:
        for state in states:
            await local.stop(state)
    assert (await local.inspect(states[1])).liveness is Liveness.GONE


async def test_stop_is_idempotent_and_safe_on_garbage_state(
    backend: LocalBackend, launch: Launch
) -> None:
    _, state = await launch()
    await backend.stop(state)
    await backend.stop(state)
    me = read("/proc/self/stat")
    my_start = int(me[me.rfind(")") + 2 :].split()[19])
    garbage: list[Any] = [
        {},
        {"sandbox_id": "../../etc"},
        {"sandbox_id": 42, "pids": "nope"},
        {"sandbox_id": "sbx_garbage", "pids": {"init": {"pid": os.getpid(), "start": my_start}}},
        {"sandbox_id": "sbx_garbage", "pids": {"outer": {"pid": 1, "start": 0}}},
        {"sandbox_id": "sbx_garbage", "cgroups": [{"path": "/sys/fs/cgroup/pids", "kill": "x"}]},
        {"sandbox_id": "sbx_garbage", "cgroups": [{"path": "/sys/fs/cgroup/pids/../ivy-x"}]},
        {"sandbox_id": "sbx_garbage", "cgroups": "not a list", "namespaces": None},
    ]
    for junk in garbage:
        await backend.stop(junk)
        assert (await backend.inspect(junk)).liveness is Liveness.GONE
    assert alive(os.getpid())
    assert existing(["/sys/fs/cgroup/pids"])


async def test_stop_after_a_partial_start_cleans_up(backend: LocalBackend, tmp_path: Path) -> None:
    spec = SandboxSpec(sandbox_id="sbx_partial", chat_id="chat_p")
    task = asyncio.create_task(backend.start(spec))
    await asyncio.sleep(0.005)  # somewhere inside start
    task.cancel()
    state: BackendState = {"sandbox_id": "sbx_partial"}
    with contextlib.suppress(asyncio.CancelledError):
        state = await task
    await backend.stop(state)
    assert not existing([tmp_path / "data" / "sandboxes" / "sbx_partial"])
    assert not cgroups_named("ivy-*-sbx_partial")
    assert await backend.list_sandboxes() == {}


async def test_list_sandboxes_finds_running_ones_with_usable_state(
    backend: LocalBackend, launch: Launch
) -> None:
    _, a = await launch("chat_a")
    _, b = await launch("chat_b")
    found = await backend.list_sandboxes()
    assert set(found) == {a["sandbox_id"], b["sandbox_id"]}
    for state in found.values():
        assert (await backend.exec(state, ExecRequest(["true"]))).exit_code == 0
    await backend.stop(a)
    assert set(await backend.list_sandboxes()) == {b["sandbox_id"]}


# -- limit mechanisms this machine does not have --------------------------------------------
async def test_without_cgroups_rlimits_are_the_reported_fallback(tmp_path: Path) -> None:
    try:
        backend = LocalBackend(tmp_path / "data")
    except BackendError as exc:
        service_unavailable(f"bubblewrap cannot run here: {exc.message}")
    backend._cgroups = cgroups.CgroupSupport()  # as on a machine with no usable cgroup
    assert backend.enforced_limits().memory == "rlimit (RLIMIT_AS, per process)"
    assert backend.enforced_limits().pids.startswith("rlimit (RLIMIT_NPROC")
    assert backend.enforced_limits().cpu == "none"
    # RLIMIT_NPROC counts every process of the host uid (other sandboxes too): be generous.
    spec = SandboxSpec("sbx_rlimits", "chat_r", limits=ResourceLimits(256 * MB, 1000, 1.0))
    state = await backend.start(spec)
    try:
        assert state["cgroups"] == []
        limits = read(f"/proc/{state['pids']['command']['pid']}/limits")
        assert re.search(r"Max processes\s+1000\s+1000", limits)
        assert re.search(rf"Max address space\s+{256 * MB}\s+{256 * MB}", limits)
        inside = await backend.exec(state, ExecRequest(["cat", "/proc/self/limits"]))
        assert re.search(rb"Max processes\s+1000\s+1000", inside.stdout)
        slow = await sh(backend, state, "sleep 300 & sleep 301", timeout_seconds=0.5)
        assert (slow.exit_code, slow.timed_out) == (137, True)
        left = await sh(backend, state, "ps -eo args | grep -c '[s]leep 30'")
        assert left.stdout == b"0\n"
    finally:
        await backend.stop(state)
    assert not existing([f"/proc/{state['pids'][role]['pid']}" for role in ("init", "command")])


def test_cgroup_v2_layouts_are_detected_and_limited(tmp_path: Path) -> None:
    """No v2 machine here: a fake v2 tree checks the parsing and the files written."""
    base = tmp_path / "cg" / "service.slice"
    base.mkdir(parents=True)
    (base / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (base / "cgroup.subtree_control").write_text("cpu memory pids\n")  # already delegated
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text("0::/service.slice\n")
    (proc / "mountinfo").write_text(
        f"35 24 0:30 / {tmp_path / 'cg'} rw,nosuid,nodev - cgroup2 cgroup2 rw,nsdelegate\n"
    )
    support = cgroups.detect(proc)
    assert support.hierarchies == (
        cgroups.Hierarchy(2, base, frozenset({"cpu", "memory", "pids"}), None),
    )
    assert support.enforced().summary() == "memory: cgroup v2; pids: cgroup v2; cpu: cgroup v2"
    (made,) = cgroups.create(support, "ivy-sbx_v2", ResourceLimits(64 * MB, 32, 1.5))
    path = Path(made["path"])
    assert path == base / "ivy-sbx_v2"
    assert (path / "memory.max").read_text() == str(64 * MB)
    assert (path / "pids.max").read_text() == "32"
    assert (path / "cpu.max").read_text() == "150000 100000"


async def test_cancelled_starts_leave_no_process_even_without_cgroups(tmp_path: Path) -> None:
    """Without cgroups only the launcher knows a sandbox it is cloning: a cancelled start
    must stop it before looking for children, or a half-made sandbox is orphaned."""
    try:
        backend = LocalBackend(tmp_path / "data")
    except BackendError as exc:
        service_unavailable(f"bubblewrap cannot run here: {exc.message}")
    backend._cgroups = cgroups.CgroupSupport()
    for attempt in range(15):
        task = asyncio.create_task(backend.start(SandboxSpec(f"sbx_cancel{attempt}", "chat_c")))
        await asyncio.sleep(0.0015 * attempt)  # from "not started yet" to "nearly done"
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await backend.stop(await task)
    await asyncio.sleep(0.2)
    assert await backend.list_sandboxes() == {}
    assert not sandbox_uid_processes_in_our_cgroups(backend._uid)


def sandbox_uid_processes_in_our_cgroups(uid: int) -> list[int]:
    """Processes forked from this test (they share its cgroups) running as the sandbox uid."""
    ours = read("/proc/self/cgroup")
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            mine = entry.name.isdigit() and entry.stat().st_uid == uid
            if mine and read(entry / "cgroup") == ours and alive(int(entry.name)):
                found.append(int(entry.name))
    return found

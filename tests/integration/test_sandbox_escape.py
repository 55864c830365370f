"""The sandbox escape suite: code inside a real bubblewrap sandbox tries to get out.

From inside a sandbox (commands run through ``exec``, as a chat's code would), every test
tries one way out — another chat's workspace, the host's files, the control plane's data,
other sandboxes' processes, the network, memory, processes, disk, outliving a stop — and
asserts it is contained, and that the host and a second sandbox are unaffected. Each probe
is first shown to *succeed* where it should (the sandbox's own workspace, its own loopback,
its own processes, a sandbox given the network), so a broken probe cannot pass as
containment. docs/security.md names these tests.

Sandboxes run as in production on this machine: root, cgroup limits, and each workspace a
loop-mounted ext4 image with a size limit (``disk_bytes``) where the machine can do it.
Skipped, with the reason, where bwrap cannot run; tests that need a cgroup controller or the
disk limit skip alone where that is missing. The ``lab`` fixture stops every sandbox,
unmounts every workspace image and checks that no cgroup, mount or loop device is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import socket
import sqlite3
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from escape_helpers import (
    CONNECT,
    DAEMONS,
    PROBE,
    PROC_LINKS,
    SIGNALS,
    as_json,
    cgroup_members,
    live,
    loop_devices_backed_under,
    mounts_under,
    processes_in_cgroup,
    processes_in_namespace,
    snapshot,
)
from ivy_sandbox.backends import cgroups, disk_args, local_disk
from ivy_sandbox.backends.base import (
    BackendError,
    BackendState,
    ErrorCode,
    ExecRequest,
    ExecResult,
    Liveness,
    ResourceLimits,
    SandboxSpec,
)
from ivy_sandbox.backends.disk_args import Content, Found, Mounted, Step
from ivy_sandbox.backends.local import LocalBackend
from ivy_sandbox.config import PEPPER_FILE

MB = 1024 * 1024
DISK = 64 * MB  # each workspace's size limit in this suite
REPO = Path(__file__).resolve().parents[2]
LIMITS = ResourceLimits(memory_bytes=256 * MB, pids=128, cpus=1.0)


class Lab:
    """One data dir, the backends (control planes) working on it, and their sandboxes."""

    def __init__(self, data: Path) -> None:
        self.data = data
        self.backends: list[LocalBackend] = []
        self.counter = 0

    def backend(self, disk: int | None = DISK) -> LocalBackend:
        """A control plane on the lab's data dir (a second one is a restarted control plane)."""
        try:
            backend = LocalBackend(self.data, disk_bytes=disk)
        except BackendError as exc:
            pytest.skip(f"bubblewrap sandboxes cannot run on this machine: {exc.message}")
        self.backends.append(backend)
        return backend

    @property
    def main(self) -> LocalBackend:
        return self.backends[0] if self.backends else self.backend()

    def workspace(self, chat: str) -> Path:
        return self.data / "workspaces" / chat

    async def launch(
        self, chat: str, backend: LocalBackend | None = None, **spec: Any
    ) -> BackendState:
        """start → mount → probe, as the engine drives a launch."""
        backend = backend or self.main
        self.counter += 1
        spec.setdefault("limits", LIMITS)
        made = SandboxSpec(sandbox_id=f"sbx_{chat}_{self.counter}", chat_id=chat, **spec)
        state = await backend.start(made)
        state = await backend.mount(made, state)
        assert await backend.probe(made, state)
        return state

    async def sh(self, state: BackendState, script: str, **request: Any) -> ExecResult:
        command = ["/bin/sh", "-c", textwrap.dedent(script)]
        return await self.main.exec(state, ExecRequest(command, **request))

    async def py(self, state: BackendState, code: str, *argv: Any, **request: Any) -> Any:
        """Run a python program inside and return the JSON it printed last."""
        command = [
            "python3",
            "-c",
            code,
            *(a if isinstance(a, str) else json.dumps(a) for a in argv),
        ]
        result = await self.main.exec(state, ExecRequest(command, **request))
        assert result.exit_code == 0, result.stderr.decode()
        return as_json(result.stdout)

    async def probe(self, state: BackendState, paths: list[str]) -> dict[str, dict[str, bool]]:
        report: dict[str, dict[str, bool]] = await self.py(state, PROBE, paths)
        return report

    def limited(self) -> bool:
        return self.main._workspaces.limited

    def need_disk_limit(self) -> None:
        if not self.limited():
            why = self.main._workspaces.describe()
            pytest.skip(f"workspace disk limit not enforceable on this machine: {why}")


def cgroup_file(state: BackendState, controller: str, *names: str) -> Path:
    """The first of ``names`` that exists in the sandbox's cgroup holding ``controller``."""
    for group in state["cgroups"]:
        if controller in group["controllers"]:
            for name in names:
                if (Path(group["path"]) / name).exists():
                    return Path(group["path"]) / name
    pytest.skip(f"no {controller} cgroup for sandboxes on this machine (cgroups not usable)")


@pytest.fixture
async def lab(tmp_path: Path) -> AsyncIterator[Lab]:
    lab = Lab(tmp_path / "data")
    yield lab
    for backend in lab.backends:
        for state in (await backend.list_sandboxes()).values():
            await backend.stop(state)
    left = lab.main._workspaces.release() if lab.backends else []
    await asyncio.to_thread(_wait_for_loop_devices, tmp_path)
    assert not left, f"workspace images still mounted: {left}"
    assert not mounts_under(tmp_path)
    assert not loop_devices_backed_under(tmp_path)
    for backend in lab.backends:
        assert not cgroups_named(f"{backend._cgroup_prefix}*")


def cgroups_named(pattern: str) -> list[Path]:
    return list(Path("/sys/fs/cgroup").glob(f"**/{pattern}"))


def existing(paths: Any) -> list[str]:
    """Which of ``paths`` exist on the host (a sync helper: these are tiny lookups)."""
    return [str(path) for path in paths if os.path.lexists(path)]


def entries(directory: str) -> list[str]:
    return [str(p) for p in Path(directory).iterdir()] if os.path.isdir(directory) else []


def _wait_for_loop_devices(root: Path) -> None:
    """An unmounted image's loop device detaches itself (autoclear) once the last mount
    namespace holding it is gone; that can lag a stop by a moment."""
    for _ in range(500):
        if not loop_devices_backed_under(root):
            return
        time.sleep(0.01)


# -- another chat's workspace ----------------------------------------------------------------
async def two_chats(lab: Lab) -> tuple[BackendState, BackendState]:
    """chat_a (the attacker) and chat_b (the victim, with a secret file)."""
    a = await lab.launch("chat_a")
    b = await lab.launch("chat_b")
    planted = await lab.sh(a, "echo own-of-a > /workspace/own.txt")
    assert planted.exit_code == 0
    hidden = await lab.sh(b, "echo secret-of-b > /workspace/secret.txt")
    assert hidden.exit_code == 0
    return a, b


async def test_another_chats_workspace_is_unreachable_by_host_path_proc_links_or_dotdot(
    lab: Lab,
) -> None:
    a, _ = await two_chats(lab)
    victim = lab.workspace("chat_b")
    before = snapshot(victim)
    own = ["/workspace", "/workspace/own.txt", "/proc/self/root/workspace/own.txt"]
    others = [
        str(victim),
        str(victim / "secret.txt"),
        str(lab.data),
        str(lab.data / "workspaces"),
        str(lab.data / disk_args.IMAGES / "chat_b.ext4"),
        *(f"/proc/{pid}/root{victim}" for pid in ("1", "2", "self", "thread-self")),
        *(f"/proc/{pid}/cwd/../chat_b" for pid in ("1", "2", "self")),
        "/workspace/../chat_b",
        "/workspace/../../workspaces/chat_b/secret.txt",
        "/proc/self/root/../chat_b",
    ]
    report = await lab.probe(a, own + others)
    for path in own:  # the probe works: it reaches what the sandbox owns
        assert report[path] == {"exists": True, "read": True, "write": True}, path
    for path in others:
        assert report[path] == {"exists": False, "read": False, "write": False}, path
    assert snapshot(victim) == before


async def test_proc_root_and_cwd_of_every_visible_process_lead_back_into_the_same_sandbox(
    lab: Lab,
) -> None:
    a, _ = await two_chats(lab)
    await lab.sh(a, "nohup setsid sleep 1000 </dev/null >/dev/null 2>&1 &")
    seen = await lab.py(a, PROC_LINKS)
    assert len(seen["procs"]) >= 3  # bwrap (pid 1), the idle command, the background sleep
    readable = 0
    for pid, links in seen["procs"].items():
        for name, target in (("root", "/"), ("root_workspace", "/workspace")):
            if isinstance(links[name], list):  # else: not ours to inspect (pid 1 is not dumpable)
                assert links[name] == seen[target], (pid, name)
                readable += 1
        if isinstance(links["cwd"], list):  # on one of the sandbox's own filesystems
            assert links["cwd"][0] in seen["devices"], (pid, links["cwd"])
    assert readable >= 4  # the check above really ran for the sandbox's own processes


async def test_mountinfo_gives_no_path_that_leads_to_another_workspace(lab: Lab) -> None:
    a, _ = await two_chats(lab)
    mountinfo = (await lab.sh(a, "cat /proc/self/mountinfo")).stdout.decode()
    fields = [line.split() for line in mountinfo.splitlines()]
    assert any(f[4] == "/workspace" for f in fields)  # the view is the sandbox's own
    hints = {path for f in fields for path in (f[3], f[4]) if "chat_a" in path}
    if lab.limited():  # an image is mounted from its own root: nothing of the host shows
        assert not hints
        assert str(lab.data) not in mountinfo
    guesses = {h.replace("chat_a", "chat_b") for h in hints}
    guesses |= {str(Path(h).parent) for h in hints} | {str(lab.workspace("chat_b"))}
    report = await lab.probe(a, sorted(guesses))
    for path, seen in report.items():
        assert seen == {"exists": False, "read": False, "write": False}, path


async def test_symlinks_planted_in_a_workspace_reach_nothing_outside_the_sandbox(
    lab: Lab,
) -> None:
    a, _ = await two_chats(lab)
    victim = lab.workspace("chat_b")
    plant = f"""
        cd /workspace
        ln -s own.txt to-own
        ln -s {victim} to-b
        ln -s {victim}/secret.txt to-b-secret
        ln -s ../chat_b up-b
        ln -s ../../workspaces/chat_b/secret.txt up-up-b
        ln -s {lab.data}/{PEPPER_FILE} to-pepper
        ln -s /proc/1/root{victim} via-proc
    """
    assert (await lab.sh(a, plant)).exit_code == 0
    report = await lab.probe(a, ["/workspace/to-own"])
    assert report["/workspace/to-own"]["read"]
    links = ["to-b", "to-b-secret", "up-b", "up-up-b", "to-pepper", "via-proc"]
    report = await lab.probe(a, [f"/workspace/{name}" for name in links])
    for path, seen in report.items():
        assert (seen["read"], seen["write"]) == (False, False), path
    reads = await lab.sh(a, "cat /workspace/to-b-secret /workspace/up-up-b /workspace/to-b/*")
    assert b"secret-of-b" not in reads.stdout


async def test_the_control_plane_never_follows_symlinks_planted_in_a_workspace(
    lab: Lab,
) -> None:
    a, _ = await two_chats(lab)
    victim = lab.workspace("chat_b")
    os.chown(victim / "secret.txt", 4242, 4242)  # a follow-and-chown would change these
    os.chmod(victim / "secret.txt", 0o640)
    before = snapshot(victim)
    plant = f"""
        cd /workspace
        ln -s {victim} lost+found
        ln -s {victim} to-b
        ln -s {victim}/secret.txt .ivy-mount-check.1
        for i in $(seq 2 40); do ln -s {victim}/secret.txt .ivy-mount-check.$i; done
    """
    assert (await lab.sh(a, plant)).exit_code == 0
    await lab.main.stop(a)
    a = await lab.launch("chat_a")  # prepare, mount check and probe again
    if lab.limited():  # as after a reboot: mounted again, lost+found handling runs
        await lab.main.stop(a)
        lab.main._workspaces._unmount(lab.workspace("chat_a"))
        a = await lab.launch("chat_a", lab.backend())
    assert snapshot(victim) == before
    listing = await lab.sh(a, "ls -A /workspace")
    assert b"lost+found" in listing.stdout
    assert b"to-b" in listing.stdout


async def test_migrating_a_plain_workspace_copies_planted_symlinks_never_their_targets(
    lab: Lab,
) -> None:
    plain = lab.backend(disk=None)
    a = await lab.launch("chat_a", plain)
    b = await lab.launch("chat_b", plain)
    await lab.sh(b, "echo secret-of-b > /workspace/secret.txt; mkdir /workspace/dir")
    victim = lab.workspace("chat_b")
    await lab.sh(a, f"ln -s {victim} /workspace/to-b; ln -s {victim}/secret.txt /workspace/s")
    await plain.stop(a)
    before = snapshot(victim)
    limited = lab.backend()
    if not limited._workspaces.limited:
        pytest.skip(f"workspace disk limit not enforceable here: {limited._workspaces.describe()}")
    a = await lab.launch("chat_a", limited)
    assert (
        local_disk.mounted_image(lab.workspace("chat_a"), limited._workspaces.image("chat_a"))
        is Mounted.OURS
    )
    copied = snapshot(lab.workspace("chat_a"))
    assert copied["to-b"].kind == "link"
    assert copied["to-b"].digest == str(victim)
    assert copied["s"].kind == "link"
    assert set(copied) == {"to-b", "s"}  # nothing of chat_b was copied in
    assert snapshot(victim) == before


# -- the host and the control plane ------------------------------------------------------------
async def test_host_files_outside_the_binds_are_invisible_and_the_bound_ones_read_only(
    lab: Lab, tmp_path: Path
) -> None:
    state = await lab.launch("chat_a")
    marker = tmp_path / "host-marker.txt"
    marker.write_text("host only")
    candidates = [
        "/root",
        "/etc/shadow",
        "/etc/sudoers",
        "/etc/ssh",
        "/etc/hostname",
        "/var/log",
        "/boot",
        "/srv",
        "/sys",
        "/sys/fs/cgroup",
        str(REPO),
        str(REPO / "pyproject.toml"),
        str(marker),
        *entries("/home"),
        *entries("/run"),
    ]
    hidden = existing(candidates)
    hidden += [f"/proc/1/root{path}" for path in ("/etc/shadow", "/root", str(marker))]
    read_only = ["/usr", "/usr/bin", "/usr/bin/python3", "/etc/passwd", "/etc/ld.so.cache"]
    read_only += ["/proc/sysrq-trigger", "/proc/sys/kernel/hostname", "/proc/1/environ"]
    writable = ["/workspace", "/tmp", "/home/sandbox", "/dev/null"]
    report = await lab.probe(state, hidden + read_only + writable)
    for path in writable:  # the probe can write where the sandbox may
        assert report[path] == {"exists": True, "read": True, "write": True}, path
    assert report["/usr/bin/python3"]["read"]
    for path in hidden:
        assert report[path] == {"exists": False, "read": False, "write": False}, path
    for path in read_only:
        assert not report[path]["write"], path
    # / and /etc inside are bwrap's private tmpfs: what is written there stays inside.
    planted = await lab.sh(state, "echo x > /escape-root.txt && echo x > /etc/escape.txt")
    assert planted.exit_code == 0
    assert not existing(["/escape-root.txt", "/etc/escape.txt"])
    home = await lab.sh(state, "ls -A /home; ls -A /etc")
    home_entries, *_ = home.stdout.decode().split("\n", 1)
    assert home_entries == "sandbox"


async def test_the_control_planes_data_dir_database_and_pepper_are_unreachable(
    lab: Lab,
) -> None:
    a, b = await two_chats(lab)
    pepper = secrets.token_hex(32)
    (lab.data / PEPPER_FILE).write_text(pepper)
    (lab.data / PEPPER_FILE).chmod(0o600)
    with contextlib.closing(sqlite3.connect(lab.data / "ivy-sandbox.db")) as db:
        db.execute("CREATE TABLE api_keys (hash TEXT)")
        db.execute("INSERT INTO api_keys VALUES (?)", (f"db-{pepper}",))
        db.commit()
    targets = [
        str(lab.data),
        str(lab.data / PEPPER_FILE),
        str(lab.data / "ivy-sandbox.db"),
        str(lab.data / "sandboxes"),
        str(Path(b["bookkeeping"]) / "state.json"),
        str(lab.data / disk_args.IMAGES),
    ]
    targets += [f"/proc/self/root{path}" for path in targets[:3]]
    report = await lab.probe(a, [*targets, "/workspace/own.txt"])
    assert report.pop("/workspace/own.txt")["read"]
    for path, seen in report.items():
        assert seen == {"exists": False, "read": False, "write": False}, path
    await lab.sh(a, f"echo {pepper[:16]}-control > /workspace/control.txt")
    search = f"grep -rlsF {pepper[:16]} / --exclude-dir=proc --exclude-dir=sys --exclude-dir=usr"
    found = await lab.sh(a, search)
    assert found.stdout.split() == [b"/workspace/control.txt"]  # grep works; finds only that
    links = await lab.sh(a, "for f in /proc/[0-9]*/fd/*; do readlink $f; done")
    assert str(lab.data).encode() not in links.stdout


# -- other sandboxes' processes ------------------------------------------------------------------
async def test_a_sandbox_cannot_see_or_signal_another_sandboxs_processes(lab: Lab) -> None:
    a, b = await two_chats(lab)
    await lab.sh(b, "nohup setsid sleep 100000 </dev/null >/dev/null 2>&1 &")
    victims = processes_in_namespace(b["namespaces"]["pid"])
    assert len(victims) >= 3  # bwrap pid 1, the idle command, the sleep: the scan works
    starts = {pid: cgroups.start_time(pid) for pid in victims}
    own = await lab.sh(a, "sleep 1000 & p=$!; kill -9 $p && wait $p; echo killed-own $?")
    assert b"killed-own 137" in own.stdout  # signalling works on its own processes
    upto = max([*victims, os.getpid()]) + 10
    seen = await lab.py(a, SIGNALS, str(upto), [*victims, os.getpid()], timeout_seconds=30)
    assert seen["alive"]
    assert max(seen["alive"]) < 100
    for pid in [*victims, os.getpid()]:
        if pid not in seen["alive"]:
            assert seen["kill"][str(pid)] == "ProcessLookupError", pid
    ps = await lab.sh(a, "ps -eo comm")
    assert ps.stdout.split()[1:].count(b"sleep") == 1  # only its own idle command
    with contextlib.suppress(BackendError):  # kill(-1): everything it may signal; it dies
        await lab.sh(a, "kill -9 -1")
    assert {pid: cgroups.start_time(pid) for pid in victims} == starts
    assert (await lab.sh(b, "echo fine")).stdout == b"fine\n"


# -- the network ---------------------------------------------------------------------------------
def host_address() -> str | None:
    """A non-loopback address of this host (no packet is sent), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address: str = probe.getsockname()[0]
    return None if address.startswith("127.") else address


async def test_the_hosts_loopback_addresses_and_abstract_sockets_are_unreachable(
    lab: Lab,
) -> None:
    listeners = [socket.create_server(("0.0.0.0", 0), backlog=16)]  # noqa: S104 - test
    port = listeners[0].getsockname()[1]
    targets: list[list[Any]] = [["tcp", "127.0.0.1", port]]
    if address := host_address():
        targets.append(["tcp", address, port])
    with contextlib.suppress(OSError):
        listeners.append(socket.create_server(("::1", port), family=socket.AF_INET6))
        targets.append(["tcp6", "::1", port])
    abstract = socket.socket(socket.AF_UNIX)
    name = f"ivy-escape-{secrets.token_hex(6)}"
    abstract.bind("\0" + name)
    abstract.listen(16)
    listeners.append(abstract)
    targets.append(["unix", name])
    try:
        shared = await lab.launch("chat_n", network=True)  # the probe connects when it may
        reached = await lab.py(shared, CONNECT, targets)
        assert set(reached.values()) == {"connected"}, reached
        for listener in listeners:
            listener.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                while True:
                    listener.accept()[0].close()
        isolated = await lab.launch("chat_a")
        blocked = await lab.py(isolated, CONNECT, targets)
        assert "connected" not in blocked.values(), blocked
        for listener in listeners:
            with pytest.raises(BlockingIOError):
                listener.accept()  # nothing got through
        own = f"""
import socket
s = socket.create_server(("127.0.0.1", {port}))
socket.create_connection(("127.0.0.1", {port}), 2)
print('"own loopback ok"')
"""
        assert await lab.py(isolated, own) == "own loopback ok"
    finally:
        for listener in listeners:
            listener.close()


async def test_there_is_no_route_out_of_a_sandbox(lab: Lab) -> None:
    state = await lab.launch("chat_a")
    outward = [["tcp", "192.0.2.1", 80], ["tcp", "1.1.1.1", 443], ["tcp6", "2001:db8::1", 80]]
    blocked = await lab.py(state, CONNECT, outward)
    for target, error in blocked.items():
        unreachable = ("OSError: Network is unreachable", "OSError: Address family not supported")
        assert error.startswith(unreachable), (target, error)
    interfaces = await lab.sh(state, "cat /proc/net/dev; cat /proc/net/route")
    lines = interfaces.stdout.decode().splitlines()
    assert [line.split(":")[0].strip() for line in lines if ":" in line] == ["lo"]
    assert lines[-1].startswith("Iface")  # the routing table is empty
    lookup = await lab.sh(state, "getent hosts example.com; echo rc=$?")
    assert lookup.stdout.endswith(b"rc=2\n")


# -- exhausting memory, processes and disk --------------------------------------------------------
async def test_a_memory_hog_is_oom_killed_and_the_host_and_another_sandbox_carry_on(
    lab: Lab,
) -> None:
    small = ResourceLimits(memory_bytes=64 * MB, pids=64, cpus=1.0)
    hog = await lab.launch("chat_a", limits=small)
    peak = cgroup_file(hog, "memory", "memory.max_usage_in_bytes", "memory.peak")
    other = await lab.launch("chat_b")
    code = "b = bytearray(256 * 1024 * 1024); print('kept')"
    result = await lab.main.exec(hog, ExecRequest(["python3", "-c", code]))
    assert (result.exit_code, result.stdout) == (137, b"")  # SIGKILL from the OOM killer
    assert int(peak.read_text()) <= 64 * MB
    fine = "b = bytearray(96 * 1024 * 1024); print('ok')"
    assert (await lab.main.exec(other, ExecRequest(["python3", "-c", fine]))).stdout == b"ok\n"
    host = await asyncio.create_subprocess_exec("python3", "-c", "bytearray(96 << 20)")
    assert await host.wait() == 0
    assert (await lab.sh(hog, "echo still")).stdout == b"still\n"


async def test_filling_tmp_is_charged_to_the_sandboxs_memory_not_the_hosts(lab: Lab) -> None:
    small = ResourceLimits(memory_bytes=64 * MB, pids=64, cpus=1.0)
    filler = await lab.launch("chat_a", limits=small)
    peak = cgroup_file(filler, "memory", "memory.max_usage_in_bytes", "memory.peak")
    other = await lab.launch("chat_b")
    # The writer gets ENOSPC or is OOM-killed; the sandbox's own first process may be
    # killed too (then exec reports the sandbox exited): contained either way.
    try:
        result = await lab.sh(filler, "head -c 512M /dev/zero > /tmp/fill; echo rc=$?")
    except BackendError as error:
        code = error.code
    else:
        code = None
        assert result.exit_code != 0 or result.stdout != b"rc=0\n"
    assert code in (None, ErrorCode.SANDBOX_EXITED)
    assert int(peak.read_text()) <= 64 * MB
    fine = await lab.sh(other, "head -c 64M /dev/zero > /tmp/fill && echo ok")
    assert fine.stdout == b"ok\n"


async def test_a_fork_bomb_hits_the_pid_limit_while_another_sandbox_still_forks(
    lab: Lab,
) -> None:
    bomb_limits = ResourceLimits(memory_bytes=256 * MB, pids=48, cpus=1.0)
    bombed = await lab.launch("chat_a", limits=bomb_limits)
    events = cgroup_file(bombed, "pids", "pids.events")
    current = cgroup_file(bombed, "pids", "pids.current")
    other = await lab.launch("chat_b")
    # `exec sleep`: once the bomb runs, even the shell could not fork a plain `sleep`.
    script = "b() { b | b & }; b; exec sleep 600"
    bomb = asyncio.create_task(lab.sh(bombed, script, timeout_seconds=60))
    for _ in range(2000):  # until the limit is hit (a bounded wait, not a timing assertion)
        if "max 0" not in events.read_text():
            break
        await asyncio.sleep(0.005)
    assert "max 0" not in events.read_text()
    assert int(current.read_text()) <= 48
    forks = await lab.sh(other, "for i in $(seq 30); do sleep 0.01 & done; wait; echo forked")
    assert forks.stdout == b"forked\n"
    assert await (await asyncio.create_subprocess_exec("true")).wait() == 0
    assert not bomb.done()  # it was still raging while the others forked
    bomb.cancel()  # a cancelled exec kills its whole tree
    with contextlib.suppress(asyncio.CancelledError):
        await bomb
    # Killed bomb processes stay charged to pids.current until the sandbox's pid 1 reaps
    # them, a moment after the exec returns: wait (bounded) for that, then check.
    for _ in range(1000):
        if int(current.read_text()) <= 4:
            break
        await asyncio.sleep(0.01)
    assert int(current.read_text()) <= 4
    assert (await lab.sh(bombed, "echo recovered")).stdout == b"recovered\n"


async def test_filling_the_workspace_stops_at_its_disk_limit_and_spares_host_and_others(
    lab: Lab,
) -> None:
    lab.need_disk_limit()
    a, b = await two_chats(lab)
    small = await lab.sh(a, "head -c 8M /dev/zero > /workspace/small && echo ok")
    assert small.stdout == b"ok\n"  # writing works below the limit
    fill = await lab.sh(a, "head -c 200M /dev/zero > /workspace/fill; echo rc=$?")
    assert b"No space left on device" in fill.stderr
    assert fill.stdout != b"rc=0\n"
    assert (lab.workspace("chat_a") / "fill").stat().st_size < DISK
    image = lab.main._workspaces.image("chat_a")
    assert image.stat().st_blocks * 512 <= DISK  # what the host's disk holds for it
    others = await lab.sh(b, "head -c 16M /dev/zero > /workspace/big && echo ok")
    assert others.stdout == b"ok\n"
    again = await lab.sh(a, "rm /workspace/fill && head -c 8M /dev/zero > /workspace/x && echo ok")
    assert again.stdout == b"ok\n"


async def test_a_workspace_full_of_blocks_and_inodes_still_launches_and_can_be_emptied(
    lab: Lab,
) -> None:
    lab.need_disk_limit()
    a = await lab.launch("chat_a")
    inodes = """
import os
os.mkdir("/workspace/many")
n = 0
try:
    while True:
        os.close(os.open(f"/workspace/many/{n}", os.O_CREAT | os.O_WRONLY))
        n += 1
except OSError as error:
    print(f'"{error.strerror}"')
"""
    assert await lab.py(a, inodes) == "No space left on device"
    await lab.sh(a, "head -c 200M /dev/zero > /workspace/fill")
    full = await lab.sh(a, ": > /workspace/one-more")
    assert b"No space left" in full.stderr
    await lab.main.stop(a)
    a = await lab.launch("chat_a")  # the mount check accepts a full workspace
    emptied = await lab.sh(a, "rm -rf /workspace/many /workspace/fill && : > /workspace/x && ls")
    assert emptied.stdout == b"x\n"


async def test_the_disk_limit_survives_a_stop_and_a_control_plane_restart_by_adoption(
    lab: Lab,
) -> None:
    lab.need_disk_limit()
    a = await lab.launch("chat_a")
    await lab.sh(a, "echo kept > /workspace/kept.txt")
    workspace = lab.workspace("chat_a")
    (mount_line,) = [line for line in _mountinfo() if line.split()[4] == str(workspace)]
    image = lab.main._workspaces.image("chat_a").stat()
    await lab.main.stop(a)
    restarted = lab.backend()  # a new control plane finds the mount and adopts it
    a = await lab.launch("chat_a", restarted)
    assert [line for line in _mountinfo() if line.split()[4] == str(workspace)] == [mount_line]
    assert lab.main._workspaces.image("chat_a").stat().st_ino == image.st_ino
    assert (await lab.sh(a, "cat /workspace/kept.txt")).stdout == b"kept\n"
    fill = await lab.sh(a, "head -c 200M /dev/zero > /workspace/fill")
    assert b"No space left on device" in fill.stderr


def _mountinfo() -> list[str]:
    return Path("/proc/self/mountinfo").read_text().splitlines()


async def test_a_plain_workspace_from_before_the_limit_is_migrated_without_loss(
    lab: Lab,
) -> None:
    plain = lab.backend(disk=None)
    a = await lab.launch("chat_a", plain)
    make = """
        cd /workspace
        mkdir -p src/deep/er empty .hidden-dir
        echo hello > src/deep/er/file.txt; echo dot > .hidden
        head -c 300000 /dev/urandom > blob.bin; chmod 600 blob.bin
        ln blob.bin blob-hardlink; ln -s src/deep link-to-dir; ln -s /nowhere dangling
        mkfifo pipe; chmod 750 src; touch -d 2001-02-03 old.txt
    """
    assert (await lab.sh(a, make)).exit_code == 0
    await plain.stop(a)
    before = snapshot(lab.workspace("chat_a"))
    limited = lab.backend()
    if not limited._workspaces.limited:
        pytest.skip(f"workspace disk limit not enforceable here: {limited._workspaces.describe()}")
    a = await lab.launch("chat_a", limited)
    workspace = lab.workspace("chat_a")
    assert local_disk.mounted_image(workspace, limited._workspaces.image("chat_a")) is (
        Mounted.OURS
    )
    assert snapshot(workspace) == before
    assert not list((lab.data / disk_args.IMAGES).glob("chat_a.plain*"))  # old copy removed
    fill = await lab.sh(a, "head -c 200M /dev/zero > /workspace/fill")
    assert b"No space left on device" in fill.stderr


async def test_a_plain_workspace_too_big_for_the_limit_stays_plain_and_intact(
    lab: Lab, caplog: pytest.LogCaptureFixture
) -> None:
    plain = lab.backend(disk=None)
    a = await lab.launch("chat_a", plain)
    await lab.sh(a, "head -c 80M /dev/urandom > /workspace/big")
    await plain.stop(a)
    before = snapshot(lab.workspace("chat_a"))
    limited = lab.backend()
    if not limited._workspaces.limited:
        pytest.skip(f"workspace disk limit not enforceable here: {limited._workspaces.describe()}")
    a = await lab.launch("chat_a", limited)
    assert local_disk.mounted_image(
        lab.workspace("chat_a"), limited._workspaces.image("chat_a")
    ) is (Mounted.NO)
    assert snapshot(lab.workspace("chat_a")) == before
    assert "NOT limited" in caplog.text
    assert not list((lab.data / disk_args.IMAGES).glob("chat_a.*ext4*"))


async def test_an_interrupted_migration_resumes_without_loss(lab: Lab) -> None:
    plain = lab.backend(disk=None)
    a = await lab.launch("chat_a", plain)
    await lab.sh(a, "mkdir d; echo one > d/one; echo two > two")
    await plain.stop(a)
    before = snapshot(lab.workspace("chat_a"))
    limited = lab.backend()
    if not limited._workspaces.limited:
        pytest.skip(f"workspace disk limit not enforceable here: {limited._workspaces.describe()}")
    images = lab.data / disk_args.IMAGES
    # As if the control plane died between moving the directory aside and renaming the image.
    (images / f"chat_a{disk_args.BUILDING_SUFFIX}").write_bytes(b"half an image")
    lab.workspace("chat_a").rename(images / f"chat_a{disk_args.ASIDE_SUFFIX}")
    a = await lab.launch("chat_a", limited)
    assert snapshot(lab.workspace("chat_a")) == before
    assert sorted(p.name for p in images.iterdir()) == ["chat_a.ext4", "chat_a.lock"]
    assert (await lab.sh(a, "cat two")).stdout == b"two\n"


async def test_a_workspace_keeps_its_image_when_the_limit_is_turned_off_later(lab: Lab) -> None:
    lab.need_disk_limit()
    a = await lab.launch("chat_a")
    await lab.sh(a, "echo kept > /workspace/kept.txt")
    await lab.main.stop(a)
    assert lab.main._workspaces.release() == []  # as after a reboot
    unlimited = lab.backend(disk=None)
    a = await lab.launch("chat_a", unlimited)  # mounts the image, not an empty directory
    assert (await lab.sh(a, "cat /workspace/kept.txt")).stdout == b"kept\n"


async def test_where_loop_devices_are_missing_the_disk_limit_is_reported_not_enforced(
    lab: Lab, tmp_path: Path
) -> None:
    backend = lab.backend()
    backend._workspaces = local_disk.detect(
        lab.data, DISK, uid=backend._uid, gid=backend._gid, loop_control=tmp_path / "none"
    )
    summary = backend.enforced_limits().summary()
    assert summary.endswith(f"; disk: not enforced (no loop devices ({tmp_path}/none is missing))")
    state = await lab.launch("chat_a", backend)
    assert local_disk.mounted_image(lab.workspace("chat_a"), Path("/")) is Mounted.NO
    assert (await lab.sh(state, "echo x > /workspace/x && cat /workspace/x")).stdout == b"x\n"
    nothing = local_disk.detect(lab.data, None, uid=0, gid=0)
    assert nothing.describe() == "not enforced (no limit configured)"


def test_the_disk_plan_converges_from_every_state_a_crash_can_leave() -> None:
    def steps(**found: Any) -> list[Step]:
        values: dict[str, Any] = {
            "mounted": Mounted.NO,
            "image": False,
            "aside": False,
            "content": Content.MISSING,
        }
        return disk_args.plan(Found(**{**values, **found}))

    assert steps() == [Step.CREATE, Step.MOUNT]
    assert steps(content=Content.EMPTY) == [Step.CREATE, Step.MOUNT]
    assert steps(content=Content.FILLED) == [Step.MIGRATE, Step.MOUNT]
    assert steps(content=Content.FILLED, busy=True) == [Step.KEEP_PLAIN]
    assert steps(image=True) == [Step.MOUNT]  # after a reboot
    assert steps(image=True, content=Content.FILLED) == [Step.MOUNT]
    assert steps(mounted=Mounted.OURS, image=True) == []  # adopted: nothing to do
    assert steps(mounted=Mounted.OURS, image=True, aside=True) == [Step.DROP_ASIDE]
    assert steps(image=True, aside=True) == [Step.DROP_ASIDE, Step.MOUNT]
    assert steps(aside=True) == [Step.RESTORE_ASIDE, Step.MIGRATE, Step.MOUNT]
    assert steps(mounted=Mounted.OTHER, image=True) == [Step.REFUSE]
    argv = disk_args.mount_argv(disk_args.DiskTools(), "/d/i.ext4", "/d/w")
    assert "nodev" in argv[-3]
    assert "nosuid" in argv[-3]
    assert "--no-dereference" in disk_args.copy_argv(disk_args.DiskTools(), "/a", "/b")


# -- outliving a stop -----------------------------------------------------------------------------
async def test_no_process_outlives_a_stop_not_even_setsid_daemons_that_ignore_sigterm(
    lab: Lab,
) -> None:
    a, b = await two_chats(lab)
    started = await lab.sh(a, DAEMONS)
    assert started.exit_code == 0
    namespace = a["namespaces"]["pid"]
    name = Path(a["cgroups"][0]["path"]).name if a["cgroups"] else None
    inside = processes_in_namespace(namespace)
    assert len(inside) >= 5  # pid 1, the idle command, three daemons (+ their sleeps)
    ignoring = [pid for pid in inside if _ignores_sigterm(pid)]
    assert len(ignoring) >= 2  # the daemons really ignore SIGTERM
    if name is not None:
        assert set(inside) <= cgroup_members(a)  # the daemons are held by the cgroup
        assert set(inside) <= set(processes_in_cgroup(name))
    others = processes_in_namespace(b["namespaces"]["pid"])
    await lab.main.stop(a)
    assert processes_in_namespace(namespace) == []
    assert not [pid for pid in inside if live(pid)]
    if name is not None:
        assert processes_in_cgroup(name) == []
        assert not existing(group["path"] for group in a["cgroups"])
    assert (await lab.main.inspect(a)).liveness is Liveness.GONE
    assert processes_in_namespace(b["namespaces"]["pid"]) == others
    assert (await lab.sh(b, "echo fine")).stdout == b"fine\n"


def _ignores_sigterm(pid: int) -> bool:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigIgn:"):
                return bool(int(line.split()[1], 16) & (1 << 14))  # bit of SIGTERM (15)
    return False

"""A local sandbox's recorded state and processes: finding them again, judging, killing.

Part of the local backend (``local.py``). A sandbox must be found again from its state
alone — after a control-plane restart, or from another process than the one that started
it — and that state may be stale or garbage. So nothing here trusts it: a recorded pid
counts only while its start time (and, for processes inside, its pid namespace) still
match, a cgroup path only if it is an ``ivy-…`` directory under a cgroup mount, and the
bookkeeping dir is derived from a validated sandbox id, never taken from the state.

It also owns the registry of the outer bwrap processes this process parents: each is
reaped by a thread as soon as it exits (no zombie while we live), and the registry is how
we know an exit status bwrap could not write to ``status.json``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import select
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ivy_sandbox.backends import bwrap_args as args
from ivy_sandbox.backends import cgroups
from ivy_sandbox.backends.base import BackendError, BackendState, ErrorCode

STOP_TIMEOUT = 10.0
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
# Outer bwrap processes this process started, with the thread that reaps each.
_PARENTED: dict[int, tuple[subprocess.Popen[bytes], threading.Thread]] = {}


@dataclass(frozen=True, slots=True)
class Sandbox:
    """A parsed, validated state: what exec/inspect/stop may act on."""

    sandbox_id: str
    state: BackendState
    book: Path

    def pid(self, role: str) -> tuple[Any, Any]:
        pids = self.state.get("pids")
        entry = pids.get(role) if isinstance(pids, dict) else None
        if not isinstance(entry, dict):
            return None, None
        return entry.get("pid"), entry.get("start")

    def cgroup_paths(self, mountpoints: tuple[str, ...]) -> list[tuple[Path, str | None]]:
        """Recorded cgroups that we could have made (the state may be garbage)."""
        groups = self.state.get("cgroups")
        if not isinstance(groups, list):
            return []
        return [
            (Path(g["path"]), g.get("kill"))
            for g in groups
            if isinstance(g, dict) and cgroups.is_sandbox_cgroup(str(g.get("path")), mountpoints)
        ]


def valid_id(value: str) -> str:
    """Ids become path and cgroup names: refuse anything that could escape or collide."""
    if not _ID.fullmatch(value):
        raise BackendError(ErrorCode.COMPUTE_FAILED, f"invalid id {value[:80]!r}")
    return value


def parse_state(data_dir: Path, state: Any) -> Sandbox | None:
    """The sandbox a state describes, or None; ``state.json`` (what start wrote) wins over
    what the caller hands us, which may predate the launch or come from a database."""
    if not isinstance(state, dict):
        return None
    sandbox_id = state.get("sandbox_id")
    if not isinstance(sandbox_id, str) or not _ID.fullmatch(sandbox_id):
        return None
    book = data_dir / "sandboxes" / sandbox_id
    with contextlib.suppress(OSError, ValueError):
        stored = json.loads((book / "state.json").read_text())
        if isinstance(stored, dict) and stored.get("sandbox_id") == sandbox_id:
            state = {**state, **stored}  # what start wrote beats what we were handed
    return Sandbox(sandbox_id, state, book)


def all_sandboxes(data_dir: Path) -> list[Sandbox]:
    """Every sandbox with a bookkeeping dir under ``data_dir`` (running or not)."""
    found = (
        parse_state(data_dir, {"sandbox_id": p.name}) for p in (data_dir / "sandboxes").glob("*")
    )
    return [sandbox for sandbox in found if sandbox is not None]


def write_state(book: Path, state: BackendState) -> None:
    """Atomically (write, then rename): a crash never leaves a half-written state.json."""
    temporary = book / "state.json.tmp"
    temporary.write_text(json.dumps(state, sort_keys=True))
    temporary.replace(book / "state.json")


def adopt(proc: subprocess.Popen[bytes]) -> None:
    """Reap the outer bwrap as soon as it exits, so no zombie lingers while we live."""
    reaper = threading.Thread(target=proc.wait, name=f"ivy-reap-{proc.pid}", daemon=True)
    _PARENTED[proc.pid] = (proc, reaper)
    reaper.start()


def is_running(sandbox: Sandbox) -> bool:
    """The idle first process lives, with its start time and its pid namespace."""
    pid, started = sandbox.pid("command")
    if not cgroups.is_alive(pid, started):
        return False
    with contextlib.suppress(OSError, KeyError, TypeError):
        return bool(os.readlink(f"/proc/{pid}/ns/pid") == sandbox.state["namespaces"]["pid"])
    return False


class FirstProcessWatch:
    """pidfds of first processes already found running, so a liveness check is one poll.

    The engine inspects every active sandbox once a second; the full check reads
    ``state.json``, ``/proc/PID/stat`` and a namespace link (~70 µs each, ~8 % of a core for
    500 sandboxes). A pidfd pins one process: it is opened *before* the full check passes,
    so a passing check proves it names the recorded process (a pid is not reused while its
    process lives), and it turns readable when that process exits. At most ``limit`` are
    held (descriptors are a budget shared with client connections); beyond it, the full
    check runs as before.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._fds: dict[str, int] = {}

    def alive(self, state: BackendState) -> bool:
        """True only while a watched first process of this sandbox lives."""
        sandbox_id = state.get("sandbox_id") if isinstance(state, dict) else None
        fd = self._fds.get(sandbox_id) if isinstance(sandbox_id, str) else None
        if fd is None:
            return False
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(0):
            return True
        self.forget(str(sandbox_id))
        return False

    def watch(self, sandbox: Sandbox) -> bool:
        """``is_running(sandbox)``, and if so, watch its first process from now on."""
        if len(self._fds) >= self._limit:
            return is_running(sandbox)
        self.forget(sandbox.sandbox_id)  # called directly while watched: watch afresh
        pid, _ = sandbox.pid("command")
        try:
            fd = os.pidfd_open(pid) if isinstance(pid, int) and pid > 0 else -1
        except OSError:
            fd = -1
        running = is_running(sandbox)  # after the open: the fd is that process, or moot
        if fd >= 0:
            if running:
                self._fds[sandbox.sandbox_id] = fd
            else:
                os.close(fd)
        return running

    def forget(self, sandbox_id: str) -> None:
        fd = self._fds.pop(sandbox_id, None)
        if fd is not None:
            os.close(fd)

    def prune(self) -> None:
        """Close the descriptors of processes that exited unseen (stopped by another
        process, their records gone, so never inspected here again)."""
        for sandbox_id in list(self._fds):
            self.alive({"sandbox_id": sandbox_id})

    def close(self) -> None:
        for sandbox_id in list(self._fds):
            self.forget(sandbox_id)


def exit_status(sandbox: Sandbox) -> int | None:
    """From bwrap's status file (written even with no control plane alive), else from the
    outer bwrap if we are its parent."""
    with contextlib.suppress(OSError):
        code = args.exit_code_from_status((sandbox.book / "status.json").read_text())
        if code is not None:
            return code
    pid, _ = sandbox.pid("outer")
    entry = _PARENTED.get(pid) if isinstance(pid, int) else None
    if entry is None or entry[0].returncode is None:
        return None
    return args.exit_code(entry[0].returncode)


async def kill_all(sandbox: Sandbox, groups: list[tuple[Path, str | None]]) -> set[int]:
    """Kill every process (cgroup-wide, then recorded pids) and wait until none is left or
    STOP_TIMEOUT passes; returns the pids still left (empty: all gone)."""
    began = time.monotonic()
    while True:
        # For a second, spare host-side processes (outer bwrap, nsenter): they reap what
        # dies inside and exit by themselves. Then kill whatever is left.
        spare = time.monotonic() - began < 1.0
        for path, how in groups:
            await cgroups.kill(path, how, spare_host_side=spare)
        recorded = _own_pids(sandbox)
        cgroups.kill_pids(recorded - {sandbox.pid("outer")[0]} if spare else recorded)
        await _reap(sandbox)
        remaining = recorded | {p for path, _ in groups for p in cgroups.members(path)}
        if not remaining or time.monotonic() - began > STOP_TIMEOUT:
            return remaining
        await asyncio.sleep(0.01)


async def _reap(sandbox: Sandbox) -> None:
    """Once our outer bwrap has died, let its reaper finish (stop returns with no zombie)."""
    pid, started = sandbox.pid("outer")
    entry = _PARENTED.get(pid) if isinstance(pid, int) else None
    if entry is not None and not cgroups.is_alive(pid, started):
        await asyncio.to_thread(entry[1].join, 1.0)


def _own_pids(sandbox: Sandbox) -> set[int]:
    """Recorded pids still alive *and* still ours (pid namespace or bwrap binary)."""
    found: set[int] = set()
    for role in ("outer", "init", "command"):
        pid, started = sandbox.pid(role)
        if not cgroups.is_alive(pid, started):
            continue
        with contextlib.suppress(OSError, KeyError, TypeError):
            if role == "outer":
                exe = Path(os.readlink(f"/proc/{pid}/exe")).name
                ours = exe.startswith("bwrap") or pid in _PARENTED
            else:
                ours = os.readlink(f"/proc/{pid}/ns/pid") == sandbox.state["namespaces"]["pid"]
            if ours:
                found.add(pid)
    return found

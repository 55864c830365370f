"""Running one command in a local sandbox: ``LocalBackend.exec`` (and the mount check and
readiness probe, which go through the same path).

Part of the local backend (``local.py``). Why it looks the way it does:

- ``nsenter`` does not join cgroups, so the exec'd process goes through the same gate as
  the launch (``bwrap_args.gated``): we place it in the sandbox's cgroups, plus a fresh
  per-exec cgroup, before it can fork. That per-exec cgroup is what lets a timeout kill
  everything the command started, double-forked and ``setsid``'d processes included.
- Output is read concurrently and capped (``local_child.Child``): the first
  ``output_limit_bytes`` of each stream are kept and the rest drained, so the command never
  blocks on a pipe.
- The gate is spawned with ``Popen`` (vfork), not ``loop.subprocess_exec``, whose uvloop
  version forks the whole server with the loop blocked (``local_child``); root's groups are
  dropped with ``setpriv``, since ``extra_groups=`` would rule out vfork.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import time
from pathlib import Path

from ivy_sandbox.backends import bwrap_args as args
from ivy_sandbox.backends import cgroups, local_child
from ivy_sandbox.backends import local_procs as procs
from ivy_sandbox.backends.base import BackendError, ErrorCode, ExecRequest, ExecResult

DRAIN_GRACE = 0.5  # after exit, wait this long for background holders of our pipes
NS_GET_PARENT = 0xB702  # ioctl: the parent of a user namespace (linux/nsfs.h)


async def run(
    sandbox: procs.Sandbox,
    request: ExecRequest,
    *,
    nsenter: str,
    setpriv: str | None,
    mountpoints: tuple[str, ...],
) -> ExecResult:
    """Run one command inside, in its own cgroup so a timeout can kill all it started.

    ``setpriv`` is given when we are root: the exec then starts with it (``nsenter_argv``),
    dropping root's supplementary groups and setting no_new_privs.
    """
    command_pid, _ = sandbox.pid("command")
    started = time.monotonic()
    try:
        parent = None if sandbox.state.get("enter_as_root") else _parent_userns(command_pid)
    except OSError as error:
        raise BackendError(ErrorCode.SANDBOX_EXITED, f"sandbox namespaces: {error}") from None
    fds = () if parent is None else (parent,)
    try:
        argv = args.nsenter_argv(
            nsenter,
            command_pid,
            cwd=request.cwd,
            env=request.env,
            command=request.command,
            parent_userns_fd=parent,
            **({"setpriv": setpriv} if setpriv is not None else {}),
        )
        try:
            targets, group = cgroups.new_exec_group(sandbox.cgroup_paths(mountpoints))
        except OSError as error:
            raise BackendError(ErrorCode.SANDBOX_EXITED, f"sandbox cgroups: {error}") from None
        try:
            return await _run(sandbox, argv, targets, group, request, started, fds)
        finally:
            if group is not None:
                cgroups.remove(group)  # fails (harmlessly) while background processes remain
    finally:
        for fd in fds:
            os.close(fd)


async def _run(
    sandbox: procs.Sandbox,
    argv: list[str],
    targets: list[Path],
    group: Path | None,
    request: ExecRequest,
    started: float,
    pass_fds: tuple[int, ...],
) -> ExecResult:
    """One gated exec from spawn to result; on an error or a cancellation its whole tree is
    killed before we return, so nothing it started outlives the call unaccounted for."""
    child = _spawn(argv, request.output_limit_bytes, pass_fds)
    try:
        _release(child, sandbox, targets, request.stdin)
        timed_out = await _wait(child, group, request.timeout_seconds)
    finally:
        if not child.exited.done():  # an error or cancellation: leave nothing behind
            await _kill_exec(child.pid, group, child.exited)
        child.close()
    exit_code = 137 if timed_out else args.exit_code(child.returncode)
    if exit_code != 0 and not timed_out and not procs.is_running(sandbox):
        raise BackendError(ErrorCode.SANDBOX_EXITED, "the sandbox exited")
    return ExecResult(
        exit_code=exit_code,
        stdout=bytes(child.streams[1]),
        stderr=bytes(child.streams[2]),
        duration_ms=int((time.monotonic() - started) * 1000),
        truncated=child.truncated,
        timed_out=timed_out,
    )


def _spawn(argv: list[str], limit: int, pass_fds: tuple[int, ...]) -> local_child.Child:
    """Start the gate (blocked on stdin) that will become ``argv``."""
    gated = args.gated(argv, stdin_to_null=False)
    return local_child.Child(gated, limit=limit, env={"PATH": args.DEFAULT_PATH}, pass_fds=pass_fds)


def _release(
    child: local_child.Child,
    sandbox: procs.Sandbox,
    targets: list[Path],
    stdin: bytes,
) -> None:
    """Place the gate in the sandbox's cgroups (and rlimits) before it can fork, then open
    it: its first line of stdin, followed by the command's stdin and EOF."""
    try:
        cgroups.join(targets, child.pid)
        cgroups.apply_rlimits(child.pid, sandbox.state.get("rlimits") or {})
    except OSError as error:
        raise BackendError(ErrorCode.SANDBOX_EXITED, f"sandbox cgroups: {error}") from None
    child.feed(b"go\n" + stdin)


async def _wait(child: local_child.Child, group: Path | None, within: float) -> bool:
    """Wait for the command (killing its tree after ``within`` seconds; returns whether it
    timed out), then at most DRAIN_GRACE for background processes holding our pipes."""
    timed_out = False
    try:
        await asyncio.wait_for(asyncio.shield(child.exited), within)
    except TimeoutError:
        timed_out = True
        await _kill_exec(child.pid, group, child.exited)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(child.closed), DRAIN_GRACE)
    return timed_out


def _parent_userns(pid: int) -> int:
    """An fd of the user namespace bwrap did its setup in (the parent of the sandbox's)."""
    own = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    try:
        return fcntl.ioctl(own, NS_GET_PARENT)
    finally:
        os.close(own)


async def _kill_exec(pid: int | None, group: Path | None, exited: asyncio.Future[None]) -> None:
    """Kill one exec's whole tree (its cgroup if it has one, else its process tree): first
    what runs inside the sandbox, so nsenter reaps its child and exits by itself, then,
    if it has not within a second, everything."""
    how = "cgroup.kill" if group is not None and (group / "cgroup.kill").exists() else "freezer"
    for spare in (True, False):
        if group is not None:
            await cgroups.kill(group, how, spare_host_side=spare)
        if pid is not None:
            descendants = cgroups.descendants(pid)
            cgroups.kill_pids(descendants if spare else [*descendants, pid])
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(exited), 1.0 if spare else procs.STOP_TIMEOUT)
            return

"""Running one command in a local sandbox: ``LocalBackend.exec`` (and the mount check and
readiness probe, which go through the same path).

Part of the local backend (``local.py``). Why it looks the way it does:

- ``nsenter`` does not join cgroups, so the exec'd process goes through the same gate as
  the launch (``bwrap_args.gated``): we place it in the sandbox's cgroups, plus a fresh
  per-exec cgroup, before it can fork. That per-exec cgroup is what lets a timeout kill
  everything the command started, double-forked and ``setsid``'d processes included.
- Output is read concurrently and capped (``_Capture``): the first ``output_limit_bytes``
  of each stream are kept and the rest drained, so the command never blocks on a pipe.
- ``serve`` runs on uvloop: no ``extra_groups=``/``user=``/``group=`` keywords on
  ``subprocess_exec`` (root's groups are dropped with ``setpriv``), and no isinstance checks
  on transport classes (uvloop's are not asyncio's subclasses).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import time
from pathlib import Path
from typing import cast

from ivy_sandbox.backends import bwrap_args as args
from ivy_sandbox.backends import cgroups
from ivy_sandbox.backends import local_procs as procs
from ivy_sandbox.backends.base import BackendError, ErrorCode, ExecRequest, ExecResult

DRAIN_GRACE = 0.5  # after exit, wait this long for background holders of our pipes
NS_GET_PARENT = 0xB702  # ioctl: the parent of a user namespace (linux/nsfs.h)


class _Capture(asyncio.SubprocessProtocol):
    """Keeps the first ``limit`` bytes of stdout/stderr and drains the rest, so the child
    never blocks on a full pipe however much it writes."""

    def __init__(self, limit: int) -> None:
        loop = asyncio.get_running_loop()
        self.limit = limit
        self.streams = {1: bytearray(), 2: bytearray()}
        self.truncated = False
        self.exited: asyncio.Future[None] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()

    def pipe_data_received(self, fd: int, data: bytes | str) -> None:
        buffer = self.streams[fd]
        room = self.limit - len(buffer)
        if len(data) > room:
            self.truncated = True
        if room > 0:
            buffer += data[:room] if isinstance(data, bytes) else data[:room].encode()

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: ARG002
        if not self.closed.done():
            self.closed.set_result(None)


async def run(
    sandbox: procs.Sandbox,
    request: ExecRequest,
    *,
    nsenter: str,
    setpriv: str | None,
    mountpoints: tuple[str, ...],
) -> ExecResult:
    """Run one command inside, in its own cgroup so a timeout can kill all it started.

    ``setpriv`` is given when we are root: it drops root's supplementary groups.
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
        )
        try:
            targets, group = cgroups.new_exec_group(sandbox.cgroup_paths(mountpoints))
        except OSError as error:
            raise BackendError(ErrorCode.SANDBOX_EXITED, f"sandbox cgroups: {error}") from None
        try:
            return await _run(sandbox, argv, targets, group, request, started, fds, setpriv)
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
    setpriv: str | None,
) -> ExecResult:
    """One gated exec from spawn to result; on an error or a cancellation its whole tree is
    killed before we return, so nothing it started outlives the call unaccounted for."""
    capture = _Capture(request.output_limit_bytes)
    transport = await _spawn(argv, capture, pass_fds, setpriv)
    try:
        _release(transport, sandbox, targets, request.stdin)
        timed_out = await _wait(transport, group, capture, request.timeout_seconds)
    finally:
        if not capture.exited.done():  # an error or cancellation: leave nothing behind
            await _kill_exec(transport.get_pid(), group, capture.exited)
        transport.close()
    exit_code = 137 if timed_out else args.exit_code(transport.get_returncode())
    if exit_code != 0 and not timed_out and not procs.is_running(sandbox):
        raise BackendError(ErrorCode.SANDBOX_EXITED, "the sandbox exited")
    return ExecResult(
        exit_code=exit_code,
        stdout=bytes(capture.streams[1]),
        stderr=bytes(capture.streams[2]),
        duration_ms=int((time.monotonic() - started) * 1000),
        truncated=capture.truncated,
        timed_out=timed_out,
    )


async def _spawn(
    argv: list[str], capture: _Capture, pass_fds: tuple[int, ...], setpriv: str | None
) -> asyncio.SubprocessTransport:
    """Start the gate (blocked on stdin) that will become ``argv``.

    An asyncio subprocess, unlike the launch (which must outlive this loop): the protocol
    reads both pipes on the loop, without a thread.
    """
    if setpriv is not None:
        # Drop root's supplementary groups for the exec'd process. Done with setpriv, not
        # the extra_groups= keyword: uvloop (what `serve` runs on) does not accept it.
        argv = [setpriv, "--clear-groups", "--", *argv]
    loop = asyncio.get_running_loop()
    transport, _ = await loop.subprocess_exec(
        lambda: capture,
        *args.gated(argv, stdin_to_null=False),
        env={"PATH": args.DEFAULT_PATH},
        cwd="/",
        start_new_session=True,
        pass_fds=pass_fds,
    )
    return transport


def _release(
    transport: asyncio.SubprocessTransport,
    sandbox: procs.Sandbox,
    targets: list[Path],
    stdin: bytes,
) -> None:
    """Place the gate in the sandbox's cgroups (and rlimits) before it can fork, then open
    it: its first line of stdin, followed by the command's stdin and EOF."""
    pid = transport.get_pid()
    try:
        cgroups.join(targets, pid)
        cgroups.apply_rlimits(pid, sandbox.state.get("rlimits") or {})
    except OSError as error:
        raise BackendError(ErrorCode.SANDBOX_EXITED, f"sandbox cgroups: {error}") from None
    # uvloop's pipe transports are not asyncio.WriteTransport subclasses; duck-type.
    pipe = cast(asyncio.WriteTransport, transport.get_pipe_transport(0))
    assert pipe is not None
    pipe.write(b"go\n" + stdin)
    pipe.write_eof()


async def _wait(
    transport: asyncio.SubprocessTransport, group: Path | None, capture: _Capture, within: float
) -> bool:
    """Wait for the command (killing its tree after ``within`` seconds; returns whether it
    timed out), then at most DRAIN_GRACE for background processes holding our pipes."""
    timed_out = False
    try:
        await asyncio.wait_for(asyncio.shield(capture.exited), within)
    except TimeoutError:
        timed_out = True
        await _kill_exec(transport.get_pid(), group, capture.exited)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(capture.closed), DRAIN_GRACE)
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

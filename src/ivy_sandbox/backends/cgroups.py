"""Resource limits and whole-tree kills for local sandboxes: cgroups, rlimits, /proc.

Why cgroups beneath *our own* cgroup: the service may itself sit in a delegated cgroup (a
systemd unit with ``Delegate=yes``, a container, a memory-capped job). Creating sandbox
cgroups at a hierarchy's root would escape that budget — and is often not permitted.
So in every hierarchy we create ``<own cgroup>/ivy-<data dir hash>-<sandbox id>`` (the
caller picks the name) and, for each exec, ``…/exec-<token>`` beneath it in the one
hierarchy used to kill process trees.

Both cgroup versions are handled, including hybrid machines (v1 controllers plus a v2
hierarchy without controllers, as on the development VMs): limits come from whichever
version holds the controller; trees are killed with v2 ``cgroup.kill`` where it exists,
else with the v1 freezer (freeze, SIGKILL every member, thaw — nothing can fork in
between), else by walking /proc (which cannot catch a double-forked, setsid'd escapee;
killing the sandbox's pid 1 still takes its whole pid namespace down).

Where no cgroup can be made, rlimits are the fallback, and are reported as what they are:
RLIMIT_AS caps each process (not the sandbox) and RLIMIT_NPROC counts every process of the
host uid (all sandboxes together). There is no rlimit for a CPU *rate*.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import resource
import secrets
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ivy_sandbox.backends.base import EnforcedLimits, ResourceLimits

PREFIX = "ivy-"
LIMIT_CONTROLLERS = frozenset({"memory", "pids", "cpu"})
CPU_PERIOD_US = 100_000
SUPERVISOR = "ivy-supervisor"  # v2 leaf the service moves into to delegate controllers


@dataclass(frozen=True, slots=True)
class Hierarchy:
    version: int  # 1 or 2
    base: Path  # our own cgroup here: sandbox cgroups are created beneath it
    controllers: frozenset[str]  # limit controllers usable for children of base
    kill: str | None  # "cgroup.kill", "freezer" or None


@dataclass(frozen=True, slots=True)
class CgroupSupport:
    hierarchies: tuple[Hierarchy, ...] = ()

    def version_for(self, controller: str) -> int | None:
        for hierarchy in self.hierarchies:
            if controller in hierarchy.controllers:
                return hierarchy.version
        return None

    @property
    def killer(self) -> Hierarchy | None:
        """The hierarchy whose per-exec child cgroups kill whole process trees."""
        ranked = sorted(
            (h for h in self.hierarchies if h.kill), key=lambda h: h.kill != "cgroup.kill"
        )
        return ranked[0] if ranked else None

    def enforced(self) -> EnforcedLimits:
        def how(controller: str, fallback: str) -> str:
            version = self.version_for(controller)
            return f"cgroup v{version}" if version else fallback

        return EnforcedLimits(
            memory=how("memory", "rlimit (RLIMIT_AS, per process)"),
            pids=how("pids", "rlimit (RLIMIT_NPROC, per host uid: all sandboxes together)"),
            cpu=how("cpu", "none"),
        )


# -- detection ---------------------------------------------------------------------------
def detect(proc: Path = Path("/proc/self")) -> CgroupSupport:
    """Find the hierarchies where we may create child cgroups (checked by trying)."""
    try:
        own = _own_cgroups((proc / "cgroup").read_text())
        mounts = _cgroup_mounts((proc / "mountinfo").read_text())
    except OSError:
        return CgroupSupport()
    found: list[Hierarchy] = []
    seen: set[frozenset[str]] = set()
    for mountpoint, root, fstype, options in mounts:
        if fstype == "cgroup" and not options & (LIMIT_CONTROLLERS | {"freezer"}):
            continue  # name=systemd, blkio, devices, …: nothing we use
        key = frozenset({"<v2>"}) if fstype == "cgroup2" else frozenset(options)
        path = own.get("" if fstype == "cgroup2" else _v1_key(options, own))
        if key in seen or path is None or not path.startswith(root):
            continue
        seen.add(key)
        base = Path(mountpoint) / path[len(root) :].lstrip("/")
        if base.name == SUPERVISOR:
            base = base.parent
        hierarchy = _usable(base, fstype, options)
        if hierarchy is not None:
            found.append(hierarchy)
    return CgroupSupport(tuple(found))


def _own_cgroups(text: str) -> dict[str, str]:
    """/proc/self/cgroup → {"memory": "/a/b", "cpu,cpuacct": …, "": v2 path}."""
    own: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            own[parts[1]] = parts[2]
    return own


def _v1_key(options: frozenset[str], own: dict[str, str]) -> str:
    for key in own:
        if key and set(key.split(",")) & options:
            return key
    return "\0"


def _cgroup_mounts(text: str) -> list[tuple[str, str, str, frozenset[str]]]:
    mounts = []
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            mounts.append((fields[4], fields[3], tail[0], frozenset(tail[2].split(","))))
    return mounts


def _usable(base: Path, fstype: str, options: frozenset[str]) -> Hierarchy | None:
    probe = base / f"{PREFIX}probe-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        probe.mkdir()
    except OSError:
        return None
    try:
        if fstype == "cgroup":
            kill = "freezer" if "freezer" in options else None
            return Hierarchy(1, base, LIMIT_CONTROLLERS & options, kill)
        kill = "cgroup.kill" if (probe / "cgroup.kill").exists() else None
        return Hierarchy(2, base, _enable_v2(base), kill)
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()


def _enable_v2(base: Path) -> frozenset[str]:
    """Enable memory/pids/cpu for our children; v2 forbids it while we sit in ``base``
    itself, so if we are alone there we move into a leaf first (what systemd asks of a
    delegated service)."""
    try:
        wanted = LIMIT_CONTROLLERS & set((base / "cgroup.controllers").read_text().split())
        control = base / "cgroup.subtree_control"
        missing = wanted - set(control.read_text().split())
        if missing:
            request = " ".join(f"+{c}" for c in sorted(missing))
            try:
                control.write_text(request)
            except OSError as error:
                procs = (base / "cgroup.procs").read_text().split()
                if error.errno != errno.EBUSY or procs != [str(os.getpid())]:
                    raise
                (base / SUPERVISOR).mkdir(exist_ok=True)
                (base / SUPERVISOR / "cgroup.procs").write_text(str(os.getpid()))
                control.write_text(request)
        return frozenset(wanted & set(control.read_text().split()))
    except OSError:
        return frozenset()


# -- one sandbox's cgroups -----------------------------------------------------------------
def create(support: CgroupSupport, name: str, limits: ResourceLimits) -> list[dict[str, Any]]:
    """Make ``name`` in each useful hierarchy and write its limits. JSON-serialisable result."""
    killer = support.killer
    groups: list[dict[str, Any]] = []
    try:
        for hierarchy in support.hierarchies:
            if not hierarchy.controllers and hierarchy is not killer:
                continue
            path = hierarchy.base / name
            path.mkdir()
            groups.append(
                {
                    "path": str(path),
                    "version": hierarchy.version,
                    "controllers": sorted(hierarchy.controllers),
                    "kill": hierarchy.kill if hierarchy is killer else None,
                }
            )
            _write_limits(hierarchy, path, limits)
    except OSError:
        for group in groups:
            with contextlib.suppress(OSError):
                Path(group["path"]).rmdir()
        raise
    return groups


def _write_limits(hierarchy: Hierarchy, path: Path, limits: ResourceLimits) -> None:
    has = hierarchy.controllers
    if hierarchy.version == 1:
        if "memory" in has and limits.memory_bytes is not None:
            (path / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
            _write_if_present(path / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
        if "cpu" in has and limits.cpus is not None:
            (path / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
            (path / "cpu.cfs_quota_us").write_text(str(_quota(limits.cpus)))
    else:
        if "memory" in has and limits.memory_bytes is not None:
            (path / "memory.max").write_text(str(limits.memory_bytes))
            _write_if_present(path / "memory.swap.max", "0")
        if "cpu" in has and limits.cpus is not None:
            (path / "cpu.max").write_text(f"{_quota(limits.cpus)} {CPU_PERIOD_US}")
    if "pids" in has and limits.pids is not None:
        (path / "pids.max").write_text(str(limits.pids))


def _quota(cpus: float) -> int:
    return max(1000, int(cpus * CPU_PERIOD_US))


def _write_if_present(path: Path, value: str) -> None:
    if path.exists():
        path.write_text(value)


def new_exec_group(groups: list[tuple[Path, str | None]]) -> tuple[list[Path], Path | None]:
    """Cgroups for one exec: the sandbox's own, except a fresh child in the kill hierarchy.

    ``groups`` holds (path, kill mechanism or None). Returns the directories to join and
    the per-exec one (to kill or remove afterwards).
    """
    targets: list[Path] = []
    child: Path | None = None
    for path, kill in groups:
        if kill:
            child = path / f"exec-{secrets.token_hex(4)}"
            child.mkdir()
            path = child
        targets.append(path)
    return targets, child


def join(paths: list[Path], pid: int) -> None:
    for path in paths:
        (path / "cgroup.procs").write_text(str(pid))


def members(path: Path) -> set[int]:
    """Pids in ``path`` and every cgroup beneath it (empty when it is gone)."""
    pids: set[int] = set()
    for directory, _, _ in os.walk(path):
        with contextlib.suppress(OSError, ValueError):
            text = (Path(directory) / "cgroup.procs").read_text()
            pids.update(int(p) for p in text.split())
    return pids


async def kill(path: Path, how: str | None, *, spare_host_side: bool = False) -> None:
    """SIGKILL everything in ``path`` and beneath, frozen so nothing can fork meanwhile.

    ``spare_host_side`` kills only processes inside the sandbox's pid namespace and leaves
    their host-side parents (nsenter, the outer bwrap) to reap them and exit on their own.
    Killed together, a child whose parent nsenter died first is re-parented to the *host's*
    init (its parent's pid namespace decides), a zombie until that init reaps it.
    """
    if how == "cgroup.kill" and not spare_host_side:
        with contextlib.suppress(OSError):
            (path / "cgroup.kill").write_text("1")
            return
    ours = _pid_namespace("self") if spare_host_side else None
    frozen = await _freeze(path, how, True)
    try:
        for _ in range(1 if frozen else 20):  # unfrozen: repeat to catch fresh forks
            pids = {p for p in members(path) if ours is None or _pid_namespace(p) != ours}
            if not pids:
                break
            kill_pids(pids)
            if not frozen:
                await asyncio.sleep(0.01)
    finally:
        await _freeze(path, how, False)  # thaw even if freezing never completed


# how → (control file, freeze, thaw, file to watch, text meaning "frozen")
_FREEZERS = {
    "cgroup.kill": ("cgroup.freeze", "1", "0", "cgroup.events", "frozen 1"),
    "freezer": ("freezer.state", "FROZEN", "THAWED", "freezer.state", "FROZEN"),
}


async def _freeze(path: Path, how: str | None, freeze: bool) -> bool:
    """Freeze (or thaw) with the v2 ``cgroup.freeze`` or the v1 freezer; True once frozen."""
    if how not in _FREEZERS:
        return False
    control, frozen, thawed, events, done = _FREEZERS[how]
    try:
        (path / control).write_text(frozen if freeze else thawed)
        for _ in range(100 if freeze else 0):
            if done in (path / events).read_text():
                return True
            await asyncio.sleep(0.005)
    except OSError:
        return False
    return False


def _pid_namespace(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def remove(path: Path) -> bool:
    """rmdir ``path`` and its children, deepest first; True when nothing is left."""
    if not path.exists():
        return True
    for directory, _, _ in sorted(os.walk(path), key=lambda entry: -len(entry[0])):
        with contextlib.suppress(OSError):
            Path(directory).rmdir()
    return not path.exists()


def cgroup_mountpoints() -> tuple[str, ...]:
    try:
        mounts = _cgroup_mounts(Path("/proc/self/mountinfo").read_text())
    except OSError:
        return ()
    return tuple(mountpoint for mountpoint, _, _, _ in mounts)


def is_sandbox_cgroup(path: str, mountpoints: tuple[str, ...]) -> bool:
    """Only ever kill or remove cgroups we could have made (the state may be garbage)."""
    candidate = Path(path)
    return (
        candidate.is_absolute()
        and ".." not in candidate.parts
        and candidate.name.startswith(PREFIX)
        and any(candidate.is_relative_to(m) and candidate != Path(m) for m in mountpoints)
    )


# -- rlimits (fallback) ----------------------------------------------------------------------
def fallback_rlimits(support: CgroupSupport, limits: ResourceLimits) -> dict[str, int]:
    """The rlimits to set because no cgroup enforces the limit."""
    chosen: dict[str, int] = {}
    if limits.memory_bytes is not None and support.version_for("memory") is None:
        chosen["as"] = limits.memory_bytes
    if limits.pids is not None and support.version_for("pids") is None:
        chosen["nproc"] = limits.pids
    return chosen


def apply_rlimits(pid: int, rlimits: dict[str, int]) -> None:
    names = {"as": resource.RLIMIT_AS, "nproc": resource.RLIMIT_NPROC}
    for name, value in rlimits.items():
        resource.prlimit(pid, names[name], (value, value))


# -- processes -----------------------------------------------------------------------------
def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name: [state, ppid, …]; None when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    return stat[stat.rfind(")") + 2 :].split()


def process_state(pid: int) -> str | None:
    """R, S, D, T (stopped), Z (zombie), …; None when the process is gone."""
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def start_time(pid: int) -> int | None:
    """Start time in clock ticks since boot (field 22 of /proc/PID/stat): pid-reuse guard."""
    fields = _stat_fields(pid)
    if not fields or fields[0] in ("Z", "X"):
        return None  # a zombie is not a running process
    return int(fields[19])


def is_alive(pid: Any, started: Any) -> bool:
    return (
        isinstance(pid, int) and isinstance(started, int) and pid > 1 and start_time(pid) == started
    )


def descendants(pid: int) -> list[int]:
    """Children, grandchildren, … of ``pid`` (by parent pid; setsid does not hide them)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                parent = int(stat[stat.rfind(")") + 2 :].split()[1])
                parents.setdefault(parent, []).append(int(entry))
    found, queue = [], [pid]
    while queue:
        children = parents.get(queue.pop(), [])
        found += children
        queue += children
    return found


def kill_pids(pids: set[int] | list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)

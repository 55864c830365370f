"""Helpers of the sandbox escape suite (tests/integration/test_sandbox_escape.py).

Two kinds: programs that run *inside* a sandbox and report what they could reach (as JSON,
so a test can assert on each path), and host-side scans that find a sandbox's processes
and mounts without trusting anything the sandbox or the backend says about itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Run inside with python3: for each path, can it be seen (lstat), read (a file's first bytes
# or a directory's listing) and written (a directory: create and remove a new file; a file:
# open for appending, writing nothing)? Prints {path: {"exists", "read", "write"}}.
PROBE = r"""
import json, os, sys
report = {}
for path in json.loads(sys.argv[1]):
    seen = {"exists": False, "read": False, "write": False}
    try:
        os.lstat(path)
        seen["exists"] = True
    except OSError:
        pass
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            with open(path, "rb") as f:
                f.read(16)
        seen["read"] = True
    except OSError:
        pass
    try:
        if os.path.isdir(path):
            name = os.path.join(path, ".escape-probe-%d" % os.getpid())
            os.close(os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            os.unlink(name)
        else:
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
        seen["write"] = True
    except OSError:
        pass
    report[path] = seen
print(json.dumps(report))
"""

# Run inside with python3: (st_dev, st_ino) of "/", "/workspace" and, for every process it
# can see, of /proc/N/root, /proc/N/root/workspace and /proc/N/cwd.
PROC_LINKS = r"""
import json, os
def ident(path):
    try:
        s = os.stat(path)
        return [s.st_dev, s.st_ino]
    except OSError as error:
        return error.strerror
out = {"/": ident("/"), "/workspace": ident("/workspace"), "procs": {}}
mounts = ("/", "/workspace", "/tmp", "/usr", "/home/sandbox", "/proc", "/dev", "/etc/passwd")
out["devices"] = sorted({os.stat(path).st_dev for path in mounts})
for pid in sorted(p for p in os.listdir("/proc") if p.isdigit()):
    out["procs"][pid] = {
        "root": ident(f"/proc/{pid}/root"),
        "root_workspace": ident(f"/proc/{pid}/root/workspace"),
        "cwd": ident(f"/proc/{pid}/cwd"),
    }
print(json.dumps(out))
"""

# Run inside with python3 args: which pids (1..N) answer signal 0, and what kill(pid, 9)
# does to each pid given in argv[2] (JSON list).
SIGNALS = r"""
import json, os, sys
alive = []
for pid in range(1, int(sys.argv[1]) + 1):
    try:
        os.kill(pid, 0)
        alive.append(pid)
    except ProcessLookupError:
        pass
    except PermissionError:
        alive.append(pid)
killed = {}
for pid in json.loads(sys.argv[2]):
    try:
        os.kill(pid, 9)
        killed[pid] = "killed"
    except OSError as error:
        killed[pid] = type(error).__name__
print(json.dumps({"alive": alive, "kill": killed}))
"""

# Run inside with python3 args: connect to each JSON [family, address, port] or abstract
# unix name; prints {target: "connected" | error name}.
CONNECT = r"""
import json, socket, sys
out = {}
for target in json.loads(sys.argv[1]):
    kind = target[0]
    try:
        if kind == "unix":
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(2)
            s.connect("\0" + target[1])
        else:
            family = socket.AF_INET6 if kind == "tcp6" else socket.AF_INET
            s = socket.socket(family)
            s.settimeout(2)
            s.connect((target[1], target[2]))
        out[json.dumps(target)] = "connected"
        s.close()
    except OSError as error:
        out[json.dumps(target)] = type(error).__name__ + ": " + str(error.strerror)
print(json.dumps(out))
"""

# Run inside: start daemons that try to outlive the sandbox — a double-forked, setsid'd
# shell ignoring TERM/HUP/INT, a python daemon ignoring every catchable signal with its
# fds closed, and a nohup'd setsid process — and return once all three are running.
DAEMONS = r"""
rm -f /tmp/d1 /tmp/d2 /tmp/d3
( setsid sh -c 'trap "" TERM HUP INT; echo $$ > /tmp/d1; while :; do sleep 5; done' \
    </dev/null >/dev/null 2>&1 & ) &
cat > /tmp/daemon.py <<'PY'
import os, signal, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        for sig in range(1, signal.NSIG):
            try:
                signal.signal(sig, signal.SIG_IGN)
            except (OSError, ValueError):
                pass
        with open("/tmp/d2", "w") as f:
            f.write(str(os.getpid()))
        os.closerange(0, 256)
        while True:
            time.sleep(5)
    os._exit(0)
PY
python3 /tmp/daemon.py </dev/null >/dev/null 2>&1
nohup setsid sh -c 'echo $$ > /tmp/d3; exec sleep 100000' </dev/null >/dev/null 2>&1 &
until [ -s /tmp/d1 ] && [ -s /tmp/d2 ] && [ -s /tmp/d3 ]; do sleep 0.01; done
"""


def pid_namespace(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def live(pid: int | str) -> bool:
    """A running process (a zombie has already died)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rfind(")") + 2] not in "ZX"


def processes_in_namespace(namespace: str) -> list[int]:
    """Host pids of live processes whose pid namespace is ``namespace`` (a /proc scan)."""
    return [
        int(entry)
        for entry in os.listdir("/proc")
        if entry.isdigit() and pid_namespace(entry) == namespace and live(entry)
    ]


def processes_in_cgroup(name: str) -> list[int]:
    """Host pids of live processes whose /proc/N/cgroup mentions a cgroup called ``name``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            if f"/{name}" in Path(f"/proc/{entry}/cgroup").read_text() and live(entry):
                found.append(int(entry))
    return found


def cgroup_members(state: dict[str, Any]) -> set[int]:
    pids: set[int] = set()
    for group in state.get("cgroups", []):
        for directory, _, _ in os.walk(group["path"]):
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in Path(directory, "cgroup.procs").read_text().split())
    return pids


def mounts_under(root: Path) -> list[str]:
    """Mount points at or beneath ``root`` in our mount namespace."""
    prefix = str(root)
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            found.append(point)
    return found


def loop_devices_backed_under(root: Path) -> list[str]:
    found = []
    for device in Path("/sys/block").glob("loop*"):
        with contextlib.suppress(OSError):
            backing = (device / "loop" / "backing_file").read_text().strip()
            if backing.startswith(str(root)):
                found.append(f"{device.name}: {backing}")
    return found


@dataclass(frozen=True)
class Entry:
    kind: str
    mode: int
    uid: int
    gid: int
    size: int
    digest: str  # file content hash, symlink target, or ""
    mtime_ns: int
    inode_group: int  # entries sharing an inode share this number (hard links)


def snapshot(root: Path) -> dict[str, Entry]:
    """Everything under ``root`` as plain data, nothing followed: to compare trees."""
    entries: dict[str, Entry] = {}
    inodes: dict[int, int] = {}
    for directory, dirs, files in os.walk(root):
        dirs.sort()  # the same visiting order on any filesystem (hard-link groups compare)
        for name in sorted(dirs + files):
            path = Path(directory, name)
            info = path.lstat()
            if stat.S_ISLNK(info.st_mode):
                kind, digest = "link", os.readlink(path)
            elif stat.S_ISREG(info.st_mode):
                kind, digest = "file", hashlib.sha256(path.read_bytes()).hexdigest()
            elif stat.S_ISDIR(info.st_mode):
                kind, digest = "dir", ""
            else:
                kind, digest = f"special-{stat.S_IFMT(info.st_mode):o}", ""
            group = inodes.setdefault(info.st_ino, len(inodes))
            entries[str(path.relative_to(root))] = Entry(
                kind,
                stat.S_IMODE(info.st_mode),
                info.st_uid,
                info.st_gid,
                info.st_size if kind == "file" else 0,
                digest,
                info.st_mtime_ns if kind != "dir" else 0,
                group,
            )
    return entries


def as_json(stdout: bytes) -> Any:
    return json.loads(stdout.decode().strip().splitlines()[-1])

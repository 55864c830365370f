"""Pure argv builders for the local backend: what bwrap and nsenter are asked to do.

Kept free of I/O (except :func:`detect_host_layout`, which only reads the host's top-level
symlinks) so the isolation a sandbox gets can be read, reviewed and unit-tested as data, the
way KubeSpawner's ``make_pod`` builds a pod spec without talking to Kubernetes.

Generated ``/etc`` files and status channels reach bwrap as open file descriptors. The
workspace cannot: bwrap resolves every bind source with ``realpath()`` (``--bind-fd``
included, checked with 0.11), so the unprivileged sandbox uid would need search permission
on every directory above it — which our 0700 data directory (or ``/root``) does not grant.
As root we therefore *stage* it (:func:`staged_launch`): in a private mount namespace used
only by this launch, root binds the workspace over a world-searchable directory (``/tmp``
unless that would hide something the launch needs — :func:`choose_stage`) and only then
drops to the sandbox uid and runs bwrap, which binds that directory at ``/workspace``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

INNER_UID = 1000  # the sandbox user as seen inside; mapped to the host sandbox uid
INNER_GID = 1000
USER_NAME = "sandbox"
HOME = "/home/sandbox"
HOSTNAME = "sandbox"
WORKSPACE = "/workspace"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
IDLE_COMMAND = ("sleep", "infinity")

# Host /etc pieces a program needs to start at all (dynamic linker, Debian alternatives,
# time zone). Bound read-only with --ro-bind-try, so a host lacking one is fine.
ETC_ALWAYS = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/alternatives",
    "/etc/localtime",
)
# Only with network: name resolution and TLS trust anchors.
ETC_NETWORK = (
    "/etc/resolv.conf",
    "/etc/nsswitch.conf",
    "/etc/host.conf",
    "/etc/gai.conf",
    "/etc/ssl",
    "/etc/ca-certificates",
    "/etc/pki",
)
# Top-level directories that merged-/usr systems make symlinks into /usr.
TOP_LEVEL = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")

# The gate: the spawned shell blocks on one line of stdin, so the control plane can put its
# pid into the sandbox's cgroups (and set rlimits) before it can exec or fork anything.
GATE_EXEC = 'read -r go || exit 125; exec "$@"'
GATE_EXEC_NO_STDIN = 'read -r go || exit 125; exec "$@" </dev/null'
# Staging (root only), in a fresh private mount namespace: open the workspace first (a bind
# source must live in the caller's mount namespace, and the stage may be one of its
# ancestors), bind it over the stage, where the sandbox uid can reach it, drop privileges.
# Mount points in a private mount namespace, not temp files:
STAGE_CANDIDATES = ("/tmp", "/mnt", "/media", "/srv", "/var/tmp", "/opt", "/home")  # noqa: S108
STAGE_SCRIPT = (
    'exec 3<"$0" && {mount} --no-canonicalize --bind /proc/self/fd/3 {stage} '
    '&& exec 3<&- && exec "$@"'
)

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True, slots=True)
class HostLayout:
    """How the host lays out what lives beside /usr: merged-/usr symlinks or real dirs."""

    symlinks: tuple[tuple[str, str], ...] = (
        ("usr/bin", "/bin"),
        ("usr/sbin", "/sbin"),
        ("usr/lib", "/lib"),
        ("usr/lib64", "/lib64"),
    )
    directories: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SandboxFds:
    """Descriptors the control plane opened for bwrap (numbers valid in the child)."""

    passwd: int  # pipes with generated file contents
    group: int
    hosts: int
    info: int  # bwrap writes {"child-pid": …} here once the namespaces exist
    status: int  # bwrap appends JSON status documents, including {"exit-code": N}


@dataclass(frozen=True, slots=True)
class BwrapConfig:
    fds: SandboxFds
    workspace: str  # host path bwrap binds at /workspace (STAGE when staged)
    network: bool = False
    layout: HostLayout = HostLayout()
    disable_userns: bool = True  # no user namespaces inside the sandbox
    tmpfs_size: int | None = None  # None: no --size (bwrap < 0.10, or no memory limit)
    hostname: str = HOSTNAME
    command: tuple[str, ...] = IDLE_COMMAND


def detect_host_layout(root: Path = Path("/")) -> HostLayout:
    """Mirror the host's top-level symlinks into /usr (or bind real dirs on split-/usr hosts)."""
    links: list[tuple[str, str]] = []
    dirs: list[str] = []
    for name in TOP_LEVEL:
        path = root / name
        if path.is_symlink():
            target = str(path.readlink())
            if not target.startswith("/") and target.startswith("usr/"):
                links.append((target, f"/{name}"))
        elif path.is_dir():
            dirs.append(f"/{name}")
    return HostLayout(tuple(links), tuple(dirs))


def bwrap_argv(bwrap: str, config: BwrapConfig) -> list[str]:
    """The full bwrap command line for one sandbox's long-lived first process.

    No ``--die-with-parent``: the sandbox must outlive a control-plane restart.
    """
    argv = [bwrap, "--unshare-all", "--unshare-user"]
    if config.network:
        argv.append("--share-net")
    if config.disable_userns:
        argv.append("--disable-userns")
    argv += ["--uid", str(INNER_UID), "--gid", str(INNER_GID)]
    argv += ["--hostname", config.hostname, "--new-session"]
    argv += _filesystem(config)
    argv += ["--bind", config.workspace, WORKSPACE, "--chdir", WORKSPACE]
    argv += ["--info-fd", str(config.fds.info), "--json-status-fd", str(config.fds.status)]
    return [*argv, "--", *config.command]


def _filesystem(config: BwrapConfig) -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for target, link in config.layout.symlinks:
        args += ["--symlink", target, link]
    for directory in config.layout.directories:
        args += ["--ro-bind", directory, directory]
    args += ["--proc", "/proc", "--dev", "/dev", "--perms", "0755", "--dir", "/etc"]
    for path in ETC_ALWAYS + (ETC_NETWORK if config.network else ()):
        args += ["--ro-bind-try", path, path]
    for fd, path in (
        (config.fds.passwd, "/etc/passwd"),
        (config.fds.group, "/etc/group"),
        (config.fds.hosts, "/etc/hosts"),
    ):
        args += ["--perms", "0644", "--ro-bind-data", str(fd), path]
    args += [*_size(config), "--perms", "1777", "--tmpfs", "/tmp"]  # noqa: S108 - inside
    args += ["--perms", "0755", "--dir", "/home"]
    args += [*_size(config), "--perms", "0700", "--tmpfs", HOME]
    return args


def _size(config: BwrapConfig) -> list[str]:
    return [] if config.tmpfs_size is None else ["--size", str(config.tmpfs_size)]


def passwd_text() -> str:
    return (
        "root:x:0:0:root:/root:/usr/sbin/nologin\n"
        f"{USER_NAME}:x:{INNER_UID}:{INNER_GID}:{USER_NAME}:{HOME}:/bin/sh\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    )


def group_text() -> str:
    return f"root:x:0:\n{USER_NAME}:x:{INNER_GID}:\nnogroup:x:65534:\n"


def hosts_text(hostname: str = HOSTNAME) -> str:
    return f"127.0.0.1\tlocalhost {hostname}\n::1\tlocalhost ip6-localhost ip6-loopback\n"


def exec_environment(extra: Mapping[str, str]) -> dict[str, str]:
    """A clean environment: nothing of the control plane's leaks into the sandbox."""
    env = {"PATH": DEFAULT_PATH, "HOME": HOME, "LANG": "C.UTF-8", "USER": USER_NAME}
    for name, value in extra.items():
        if not _ENV_NAME.fullmatch(name) or "\0" in value:
            raise ValueError(f"invalid environment variable {name!r}")
        env[name] = value
    return env


def nsenter_argv(
    nsenter: str,
    target_pid: int,
    *,
    cwd: str,
    env: Mapping[str, str],
    command: Sequence[str],
    parent_userns_fd: int | None = None,
    setpriv: str = "/usr/bin/setpriv",
) -> list[str]:
    """Run ``command`` inside a sandbox: its namespaces, its user, a clean environment.

    bwrap nests user namespaces (with ``--dev`` or ``--uid`` it does its setup in an outer
    one, then runs the sandbox in a child of it), and the sandbox's other namespaces belong
    to the *outer* one. So the sandbox user's namespace has to be entered last:

    * as root (``parent_userns_fd`` None), nsenter's own order does it — every other
      namespace first, the user namespace last — and ``-S``/``-G`` then become the sandbox
      user. One ``setpriv`` in front drops root's supplementary groups and sets
      no_new_privs, which nsenter and the command inherit and cannot undo: no setuid or
      file-capability gains. (In front, not inside: one program less per exec, measured
      ~1 ms each);
    * unprivileged, we enter the outer user namespace (our own: we have capabilities there)
      and the others, then a second nsenter joins the sandbox's own user namespace, that of
      its pid 1, keeping our (mapped, unprivileged) credentials.

    ``env -i -C`` then sets the environment and working directory from inside.
    """
    if not command:
        raise ValueError("command must not be empty")
    if "=" in command[0]:
        raise ValueError("command[0] must not contain '=' (env would read it as a variable)")
    if parent_userns_fd is None:
        argv = [setpriv, "--clear-groups", "--no-new-privs", "--", nsenter, "-t", str(target_pid)]
        argv += ["-a", "-S", str(INNER_UID), "-G", str(INNER_GID), "--"]
    else:
        argv = [nsenter, "-t", str(target_pid)]
        argv += [f"--user=/proc/self/fd/{parent_userns_fd}", "--preserve-credentials"]
        argv += ["-m", "-u", "-i", "-n", "-p", "-C", "--"]
        argv += ["/usr/bin/nsenter", "--user=/proc/1/ns/user", "--preserve-credentials", "--"]
    assignments = [f"{k}={v}" for k, v in exec_environment(env).items()]
    return [*argv, "/usr/bin/env", "-i", "-C", cwd, *assignments, *command]


@dataclass(frozen=True, slots=True)
class Tools:
    """Host programs (util-linux) the root launch path needs, as absolute paths."""

    unshare: str = "/usr/bin/unshare"
    mount: str = "/usr/bin/mount"
    setpriv: str = "/usr/bin/setpriv"


def choose_stage(
    needed: Sequence[str],
    usable: Callable[[str], bool],
    candidates: Sequence[str] = STAGE_CANDIDATES,
) -> str | None:
    """The first candidate directory that ``usable`` accepts (exists, world-searchable) and
    that is not an ancestor of any ``needed`` path — binding over it must not hide bwrap or
    the tools the launch runs after the bind (a venv under /tmp, say). None if none fits."""
    for candidate in candidates:
        inside = candidate.rstrip("/") + "/"
        if usable(candidate) and not any(path.startswith(inside) for path in needed):
            return candidate
    return None


def staged_launch(
    argv: Sequence[str], *, workspace: str, stage: str, uid: int, gid: int, tools: Tools
) -> list[str]:
    """Root: stage the workspace at ``stage`` (see the module docstring), then become ``uid``
    with no groups, no capabilities (bounding set included) and no_new_privs, then ``argv``."""
    script = STAGE_SCRIPT.format(mount=tools.mount, stage=stage)
    drop = [tools.setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
    drop += ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
    unshare = [tools.unshare, "--mount", "--propagation", "private", "--"]
    return [*unshare, "/bin/sh", "-c", script, workspace, *drop, *argv]


def gated(argv: Sequence[str], *, stdin_to_null: bool) -> list[str]:
    """Wrap ``argv`` so it waits for one line on stdin before it runs (see GATE_EXEC)."""
    script = GATE_EXEC_NO_STDIN if stdin_to_null else GATE_EXEC
    return ["/bin/sh", "-c", script, "ivy-gate", *argv]


def parse_bwrap_version(text: str) -> tuple[int, int, int] | None:
    """``bubblewrap 0.11.0`` → (0, 11, 0); None when unparseable."""
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", text)
    if match is None:
        return None
    major, minor, patch = (int(part) for part in match.groups())
    return major, minor, patch


# -- reading what comes back ---------------------------------------------------------------------
# The mount check: (st_dev, st_ino) of /workspace as seen inside, then a write as the sandbox
# user. A bind mount keeps both numbers, so they must equal the host directory's. The file
# gets a random name created with O_EXCL (mktemp): the chat's own files, or a symlink it
# planted, cannot make the check fail or write elsewhere. A workspace filled to its disk
# limit still passes (the chat must be able to launch to clean it up): "no space" counts as
# writable when the permission is there.
MOUNT_CHECK = (
    'stat -c "%d %i" /workspace && '
    'if t=$(mktemp -p /workspace .ivy-mount-check.XXXXXXXX 2>&1); then rm -f -- "$t"; '
    'else case $t in *"No space left"*|*"quota exceeded"*) test -w /workspace;; '
    '*) echo "$t" >&2; exit 1;; esac; fi'
)
READINESS_PROBE = "cd /workspace && ls -a >/dev/null"


def exit_code(returncode: int | None) -> int:
    """A process's return code as a shell reports it: 128+N when killed by signal N."""
    if returncode is None:
        return 137
    return 128 - returncode if returncode < 0 else returncode


def exit_code_from_status(text: str) -> int | None:
    """The last ``{"exit-code": N}`` document bwrap wrote to its --json-status-fd."""
    for line in reversed(text.splitlines()):
        try:
            document = json.loads(line)
        except ValueError:
            continue
        if isinstance(document, dict) and isinstance(document.get("exit-code"), int):
            return int(document["exit-code"])
    return None

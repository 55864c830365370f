"""Pure pieces of the per-workspace disk limit: what to do with a chat's workspace, and the
exact command lines that do it. No I/O here (``local_disk`` runs them), so the decision
table and the options a workspace filesystem gets can be read and unit-tested as data.

The limit: each chat's workspace is a sparse ext4 image, ``DATA/workspace-images/<chat>.ext4``,
loop-mounted by the control plane (root) at ``DATA/workspaces/<chat>`` the first time the
workspace is needed and kept mounted across sandbox lifetimes (and control-plane restarts:
a later start finds the mount and adopts it). A sandbox filling its workspace gets ENOSPC
from its own filesystem; the host's filesystem only ever holds what was written (sparse), at
most the image size per chat.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

IMAGES = "workspace-images"  # beside "workspaces" in the data dir; 0700, root's
IMAGE_SUFFIX = ".ext4"
BUILDING_SUFFIX = ".ext4.building"  # an image being made; never mounted at the workspace
MIGRATING_SUFFIX = ".migrating"  # where a new image is mounted while a plain dir is copied in
ASIDE_SUFFIX = ".plain"  # a migrated plain directory, moved aside until the image is in use
LOCK_SUFFIX = ".lock"
# Mount options: no device files and no setuid from a workspace; atime updates are writes.
MOUNT_OPTIONS = "loop,nodev,nosuid,noatime"
MIN_DISK = 16 * 1024 * 1024


class Mounted(StrEnum):
    OURS = "ours"  # the chat's image is mounted at the workspace
    OTHER = "other"  # something else is mounted there
    NO = "no"


class Content(StrEnum):
    MISSING = "missing"
    EMPTY = "empty"
    FILLED = "filled"


@dataclass(frozen=True, slots=True)
class Found:
    """What ``local_disk`` observed about one chat's workspace (under its lock)."""

    mounted: Mounted
    image: bool  # DATA/workspace-images/<chat>.ext4 exists (complete: renamed into place)
    aside: bool  # a plain dir moved aside by a migration that had not finished cleaning up
    content: Content  # of the workspace directory, when nothing is mounted on it
    busy: bool = False  # a sandbox of this chat is running on the plain directory


class Step(StrEnum):
    REFUSE = "refuse"  # something else is mounted at the workspace: fail the launch
    DROP_ASIDE = "drop-aside"  # the image holds a full copy of it: delete it
    RESTORE_ASIDE = "restore-aside"  # the migration did not finish: put it back, start over
    CREATE = "create"  # make and format a new image
    MIGRATE = "migrate"  # make an image and copy the plain directory into it
    MOUNT = "mount"  # mount the image at the workspace
    KEEP_PLAIN = "keep-plain"  # not now: a sandbox of the chat still uses the plain dir


def plan(found: Found) -> list[Step]:
    """The steps that bring a workspace to "its image mounted at it", safely from any state
    a crash can leave (see ``local_disk`` for the order of a migration's renames).

    An image only exists once it is complete (built under another name, then renamed), so
    "image exists" means any plain directory left aside is fully copied and may go.
    """
    if found.mounted is Mounted.OTHER:
        return [Step.REFUSE]
    steps = [Step.DROP_ASIDE] if found.aside and found.image else []
    if found.mounted is Mounted.OURS:
        return steps
    if found.image:
        return [*steps, Step.MOUNT]
    if found.aside:  # crashed between moving the plain dir aside and renaming the image
        return [Step.RESTORE_ASIDE, Step.MIGRATE, Step.MOUNT]
    if found.content is Content.FILLED:
        return [Step.KEEP_PLAIN] if found.busy else [Step.MIGRATE, Step.MOUNT]
    return [Step.CREATE, Step.MOUNT]


@dataclass(frozen=True, slots=True)
class DiskTools:
    """Host programs the disk limit runs, as absolute paths."""

    mkfs: str = "/usr/sbin/mkfs.ext4"
    mount: str = "/usr/bin/mount"
    umount: str = "/usr/bin/umount"
    cp: str = "/usr/bin/cp"


def mkfs_argv(tools: DiskTools, image: str, *, uid: int, gid: int) -> list[str]:
    """Format ``image`` (a sparse file of the limit's size) as ext4, its root owned by the
    sandbox uid. No reserved blocks (nobody privileged writes there); inode tables and the
    journal are initialised lazily, so formatting writes well under a megabyte."""
    extended = f"lazy_itable_init=1,lazy_journal_init=1,nodiscard,root_owner={uid}:{gid}"
    return [tools.mkfs, "-q", "-F", "-m", "0", "-E", extended, "--", image]


def mount_argv(tools: DiskTools, image: str, target: str) -> list[str]:
    """Loop-mount ``image`` at ``target``. util-linux reuses a loop device already backed by
    the same file (so a second mount never gives the filesystem two block devices) and sets
    autoclear (the device detaches when its last mount goes)."""
    return [tools.mount, "--no-canonicalize", "-t", "ext4", "-o", MOUNT_OPTIONS, image, target]


def umount_argv(tools: DiskTools, target: str) -> list[str]:
    return [tools.umount, "--no-canonicalize", target]


def copy_argv(tools: DiskTools, source: str, target: str) -> list[str]:
    """Copy a plain workspace into a new image: everything (dotfiles too), owners, modes,
    times, hard links and xattrs kept, symlinks copied as symlinks (never followed)."""
    return [tools.cp, "-a", "--no-dereference", "--", f"{source.rstrip('/')}/.", target]


def describe(size: int | None, problem: str | None) -> str:
    """The start-up report's disk part (the same style as the memory/pids/cpu parts)."""
    if size is None:
        return "not enforced (no limit configured)"
    if problem is not None:
        return f"not enforced ({problem})"
    return f"ext4 image per workspace, {format_size(size)} each"


def format_size(size: int) -> str:
    for unit, factor in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if size >= factor and size % factor == 0:
            return f"{size // factor}{unit}"
    return f"{size} bytes"


def fits(usage: int, available: int) -> bool:
    """Whether a plain directory using ``usage`` bytes (allocated blocks) fits in a new
    image with ``available`` free bytes, keeping a little room for directory growth."""
    return usage + usage // 32 <= available


def messages(stderr: bytes, argv: Sequence[str]) -> str:
    text = stderr.decode(errors="replace").strip()
    return f"{argv[0]}: {text or 'failed'}"

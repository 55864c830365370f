"""The chat's workspace on the host, and its size limit (``IVY_SANDBOX_DISK``).

Part of the local backend (``local.py``); the decisions and command lines are in
``disk_args``. With a limit (root, loop devices usable), a workspace is an ext4 image
loop-mounted at ``DATA/workspaces/<chat>``: made and mounted the first time a sandbox of the
chat starts, then kept mounted — a later start only checks, with two ``stat`` calls and one
read of ``/sys``, that the chat's image is what is mounted there (so a restarted control
plane adopts the mounts a previous one made). Without a limit, or where the machine cannot
mount loop devices (reported at start-up), a workspace is a plain directory, as before.

Existing plain workspaces are migrated into an image at their next start, without loss: the
image is built under another name, the directory is copied in (``cp -a``: symlinks stay
symlinks, nothing is followed), the directory is moved aside, the image renamed into place
and mounted, and only then is the old directory deleted. A crash at any point leaves a state
``disk_args.plan`` resumes from. A plain workspace that does not fit its limit stays a plain
directory (not limited; logged at each start) until it does.

Everything here runs as root on paths the control plane owns (``DATA/workspaces`` and
``DATA/workspace-images`` are 0700, root's): a sandbox can only change what is *inside* its
workspace, and nothing here follows a path inside a workspace (``lost+found`` is removed
with ``rmdir`` relative to a directory opened with ``O_NOFOLLOW``).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ivy_sandbox.backends import disk_args as plan
from ivy_sandbox.backends.base import BackendError, EnforcedLimits, ErrorCode
from ivy_sandbox.backends.disk_args import Content, DiskTools, Found, Mounted, Step

log = logging.getLogger(__name__)

TOOL_PATH = "/usr/local/sbin:/usr/sbin:/sbin:/usr/local/bin:/usr/bin:/bin"
COMMAND_TIMEOUT = 120.0  # mkfs, mount, umount; a migration's copy gets no limit


@dataclass(frozen=True, slots=True)
class LocalEnforcedLimits(EnforcedLimits):
    """The cgroup/rlimit report plus how the workspace's size is limited."""

    disk: str = "not enforced"

    def summary(self) -> str:
        return f"{EnforcedLimits.summary(self)}; disk: {self.disk}"


@dataclass(frozen=True, slots=True)
class Workspaces:
    """Where chats' workspaces live and how big they may grow."""

    data_dir: Path
    uid: int
    gid: int
    size: int | None = None  # bytes per workspace; None: not limited (plain directories)
    problem: str | None = None  # why a configured size cannot be enforced here
    tools: DiskTools = field(default_factory=DiskTools)

    @property
    def limited(self) -> bool:
        return self.size is not None and self.problem is None

    def describe(self) -> str:
        return plan.describe(self.size, self.problem)

    def path(self, chat_id: str) -> Path:
        return self.data_dir / "workspaces" / chat_id

    def image(self, chat_id: str) -> Path:
        return self.data_dir / plan.IMAGES / f"{chat_id}{plan.IMAGE_SUFFIX}"

    def prepare(self, chat_id: str, busy: Callable[[], bool]) -> Path:
        """The chat's workspace, ready to bind: created, owned by the sandbox uid, 0700, and
        with a limit, its image mounted. ``busy`` tells whether a sandbox of the chat runs
        (a plain directory in use is not migrated). Blocking: run it in a thread."""
        workspace = self.path(chat_id)
        (self.data_dir / "workspaces").mkdir(mode=0o700, parents=True, exist_ok=True)
        if not self.limited and not self.image(chat_id).exists():
            with contextlib.suppress(FileExistsError):
                workspace.mkdir(mode=0o700)
            _own(workspace, self.uid, self.gid)
            return workspace
        # With a limit, or without one for a chat whose data already lives in an image (the
        # limit was turned off later): that image is mounted, never an empty directory.
        images = self.data_dir / plan.IMAGES
        images.mkdir(mode=0o700, exist_ok=True)
        with _locked(images / f"{chat_id}{plan.LOCK_SUFFIX}"):
            self._converge(chat_id, busy)
        _own(workspace, self.uid, self.gid)
        return workspace

    def _converge(self, chat_id: str, busy: Callable[[], bool]) -> None:
        workspace, image = self.path(chat_id), self.image(chat_id)
        aside = image.with_name(f"{chat_id}{plan.ASIDE_SUFFIX}")
        mounted = mounted_image(workspace, image)
        if mounted is Mounted.NO:
            self._clear_building(chat_id)
        content = _content(workspace) if mounted is Mounted.NO else Content.FILLED
        found = Found(
            mounted=mounted,
            image=image.exists(),
            aside=aside.exists(),
            content=content,
            busy=content is Content.FILLED and not image.exists() and busy(),
        )
        for step in plan.plan(found):
            if step is Step.REFUSE:
                raise BackendError(
                    ErrorCode.MOUNT_FAILED,
                    f"{workspace} has something else mounted on it, not the chat's image",
                )
            if step is Step.DROP_ASIDE:
                shutil.rmtree(aside, ignore_errors=True)
            elif step is Step.RESTORE_ASIDE:
                with contextlib.suppress(FileNotFoundError):
                    workspace.rmdir()  # made empty by the interrupted migration, if at all
                aside.rename(workspace)
            elif step is Step.CREATE:
                self._build(chat_id, None)
            elif step is Step.MIGRATE:
                if not self._build(chat_id, workspace):
                    return  # does not fit: stays a plain directory, logged
                workspace.rename(aside)
                self._building(chat_id).rename(image)
            elif step is Step.MOUNT:
                if _content(workspace) is Content.FILLED:
                    log.warning("mounting the image of %s over a non-empty directory", chat_id)
                workspace.mkdir(mode=0o700, exist_ok=True)
                self._run(plan.mount_argv(self.tools, str(image), str(workspace)))
                _remove_lost_found(workspace)
                shutil.rmtree(aside, ignore_errors=True)
            elif step is Step.KEEP_PLAIN:
                log.info("workspace of %s is in use as a plain directory: not migrated", chat_id)

    def _building(self, chat_id: str) -> Path:
        return self.data_dir / plan.IMAGES / f"{chat_id}{plan.BUILDING_SUFFIX}"

    def _build(self, chat_id: str, plain: Path | None) -> bool:
        """Make the chat's image (a plain directory's copy in it, if given) and rename it into
        place; with ``plain``, leave it under its building name for the caller to rename once
        the directory is moved aside. False when ``plain`` does not fit (nothing is left)."""
        assert self.size is not None
        building = self._building(chat_id)
        fd = os.open(building, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, self.size)  # sparse: takes no space until written
        finally:
            os.close(fd)
        try:
            self._run(plan.mkfs_argv(self.tools, str(building), uid=self.uid, gid=self.gid))
        except BaseException:
            building.unlink(missing_ok=True)
            raise
        if plain is None:
            building.rename(self.image(chat_id))
            return True
        staging = building.with_name(f"{chat_id}{plan.MIGRATING_SUFFIX}")
        staging.mkdir(mode=0o700)
        self._run(plan.mount_argv(self.tools, str(building), str(staging)))
        try:
            _remove_lost_found(staging)
            room = os.statvfs(staging)
            available = room.f_bavail * room.f_frsize
            if not plan.fits(disk_usage(plain, stop_above=available), available):
                log.warning(
                    "workspace of %s holds more than its disk limit (%s): kept as a plain "
                    "directory, NOT limited, until it fits",
                    chat_id,
                    plan.format_size(self.size),
                )
                building.unlink()
                return False
            try:
                self._run(plan.copy_argv(self.tools, str(plain), str(staging)), timeout=None)
            except BackendError as error:  # e.g. it grew meanwhile: stay plain, keep working
                log.warning("workspace of %s stays a plain directory: %s", chat_id, error)
                building.unlink()
                return False
        except BaseException:
            building.unlink(missing_ok=True)
            raise
        finally:
            self._unmount(staging)
            staging.rmdir()
        return True

    def _clear_building(self, chat_id: str) -> None:
        """Remove what an interrupted build left (never the image or a plain dir)."""
        building = self._building(chat_id)
        staging = building.with_name(f"{chat_id}{plan.MIGRATING_SUFFIX}")
        if staging.exists():
            if mounted_image(staging, building) is not Mounted.NO:
                self._unmount(staging)
            staging.rmdir()
        building.unlink(missing_ok=True)

    def _unmount(self, target: Path) -> None:
        self._run(plan.umount_argv(self.tools, str(target)))

    def _run(self, argv: list[str], timeout: float | None = COMMAND_TIMEOUT) -> None:
        done = subprocess.run(  # noqa: S603 - argv from disk_args, paths we own
            argv, capture_output=True, timeout=timeout, check=False, env={"PATH": TOOL_PATH}
        )
        if done.returncode != 0:
            raise BackendError(ErrorCode.MOUNT_FAILED, plan.messages(done.stderr, argv))

    def release(self) -> list[str]:
        """Unmount every workspace image of this data dir (for tests and operators; the
        service itself keeps them mounted). Returns the workspaces that stayed mounted."""
        left = []
        root = self.data_dir / "workspaces"
        for workspace in sorted(root.iterdir()) if root.is_dir() else []:
            if mounted_image(workspace, self.image(workspace.name)) is Mounted.NO:
                continue
            try:
                self._unmount(workspace)
            except BackendError:
                left.append(str(workspace))
        return left


def detect(
    data_dir: Path,
    size: int | None,
    *,
    uid: int,
    gid: int,
    loop_control: Path = Path("/dev/loop-control"),
) -> Workspaces:
    """Whether this machine can enforce ``size``, checked by trying: root, loop devices,
    mkfs.ext4 and util-linux, then a real (small, temporary) image formatted and mounted."""
    if size is None:
        return Workspaces(data_dir, uid, gid)

    def unenforced(problem: str) -> Workspaces:
        return Workspaces(data_dir, uid, gid, size, problem)

    if os.geteuid() != 0:
        return unenforced("mounting a workspace image needs root")
    if not loop_control.exists():
        return unenforced(f"no loop devices ({loop_control} is missing)")
    found = {name: shutil.which(name, path=TOOL_PATH) for name in ("mkfs.ext4", "mount", "cp")}
    found["umount"] = shutil.which("umount", path=TOOL_PATH)
    missing = sorted(name for name, path in found.items() if path is None)
    if missing:
        return unenforced(f"programs not found: {', '.join(missing)}")
    tools = DiskTools(
        str(found["mkfs.ext4"]), str(found["mount"]), str(found["umount"]), str(found["cp"])
    )
    workspaces = Workspaces(data_dir, uid, gid, size, None, tools)
    try:
        images = data_dir / plan.IMAGES
        images.mkdir(mode=0o700, parents=True, exist_ok=True)
        _trial(workspaces, Path(tempfile.mkdtemp(prefix=".probe-", dir=images)))
    except (OSError, BackendError, subprocess.SubprocessError) as error:
        message = error.message if isinstance(error, BackendError) else str(error)
        return unenforced(f"a loop-mounted ext4 image does not work here: {message}")
    return workspaces


def _trial(workspaces: Workspaces, directory: Path) -> None:
    image, target = directory / "probe.ext4", directory / "mnt"
    try:
        with image.open("wb") as file:
            file.truncate(plan.MIN_DISK)
        target.mkdir()
        workspaces._run(plan.mkfs_argv(workspaces.tools, str(image), uid=0, gid=0))
        workspaces._run(plan.mount_argv(workspaces.tools, str(image), str(target)))
        workspaces._unmount(target)
    finally:
        if target.exists() and mounted_image(target, image) is not Mounted.NO:
            with contextlib.suppress(BackendError):
                workspaces._unmount(target)
        shutil.rmtree(directory, ignore_errors=True)


def mounted_image(path: Path, image: Path) -> Mounted:
    """OURS when ``path`` is the root of a loop device backed by ``image``, OTHER for any
    other mount, NO for a plain directory (or nothing): two stats and one read of /sys."""
    try:
        here, parent = os.lstat(path), os.stat(path.parent)
    except OSError:
        return Mounted.NO
    if here.st_dev == parent.st_dev:
        return Mounted.NO
    sysfs = Path(f"/sys/dev/block/{os.major(here.st_dev)}:{os.minor(here.st_dev)}")
    try:
        backing = (sysfs / "loop" / "backing_file").read_text().rstrip("\n")
    except OSError:
        return Mounted.OTHER
    return Mounted.OURS if backing == str(image) else Mounted.OTHER


def disk_usage(root: Path, *, stop_above: int) -> int:
    """Bytes allocated under ``root`` (lstat: links are not followed), counting stops once
    past ``stop_above`` (the answer is "too big" then, however big)."""
    total = 0
    for directory, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(directory, name)).st_blocks * 512
        if total > stop_above:
            break
    return total


def _content(path: Path) -> Content:
    try:
        with os.scandir(path) as entries:
            return Content.FILLED if any(True for _ in entries) else Content.EMPTY
    except FileNotFoundError:
        return Content.MISSING
    except NotADirectoryError:
        return Content.FILLED


def _own(workspace: Path, uid: int, gid: int) -> None:
    """The workspace's top directory: the sandbox uid's, 0700 (never through a symlink)."""
    fd = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if (info.st_uid, info.st_gid) != (uid, gid):
            os.fchown(fd, uid, gid)
        if info.st_mode & 0o7777 != 0o700:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def _remove_lost_found(root: Path) -> None:
    """A fresh ext4 has ``lost+found``; the workspace starts empty as before (rmdir of the
    root-owned empty directory mkfs made, relative to the opened root: nothing followed)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.stat("lost+found", dir_fd=fd, follow_symlinks=False)
        if info.st_uid == 0 and (info.st_mode & 0o170000) == 0o040000:
            os.rmdir("lost+found", dir_fd=fd)
    except OSError:
        pass  # absent, not ours, or not empty: leave it
    finally:
        os.close(fd)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One process at a time per chat (two control planes could share a data dir)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)

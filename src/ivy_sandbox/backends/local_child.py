"""A short-lived child process driven from the event loop without forking the server.

Part of the local backend: every exec (and the mount check and readiness probe) starts one.
Not ``loop.subprocess_exec``: uvloop's spawn ``fork()``s the whole server and blocks the
loop until the child has exec'd — about 4 ms per spawn for a 100 MB process, measured
(``docs/performance.md``) — while CPython's ``Popen`` uses ``vfork`` (under 1 ms). The
child's pipes are plain fds read with ``add_reader``, its exit is seen through a pidfd
(a thread waits where pidfds are missing), and every fd is ours alone, closed exactly once
(no file object: see ``local_launch._read_all`` for what a double close did).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import threading
from collections.abc import Sequence

CHUNK = 65536


class Child:
    """One spawned process: capped stdout/stderr capture, stdin fed without blocking, and
    futures for its exit (``exited``) and for both output pipes at EOF (``closed``).

    The first ``limit`` bytes of each stream are kept and the rest drained, so the child
    never blocks on a full pipe however much it writes.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        limit: int,
        env: dict[str, str],
        pass_fds: Sequence[int] = (),
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self.limit = limit
        self.streams: dict[int, bytearray] = {1: bytearray(), 2: bytearray()}
        self.truncated = False
        self.exited: asyncio.Future[None] = self._loop.create_future()
        self.closed: asyncio.Future[None] = self._loop.create_future()
        self._open: dict[int, int] = {}  # our read end -> stream number (1 or 2)
        self._stdin: int | None = None
        self._writer: int | None = None  # stdin, while a writer callback is registered
        self._feeding: asyncio.Task[None] | None = None
        self._proc = self._spawn(argv, env, pass_fds)
        self.pid = self._proc.pid
        self._watch_exit()

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    def _spawn(
        self, argv: Sequence[str], env: dict[str, str], pass_fds: Sequence[int]
    ) -> subprocess.Popen[bytes]:
        ends = [os.pipe() for _ in range(3)]  # stdin, stdout, stderr: (read, write) each
        child_ends = (ends[0][0], ends[1][1], ends[2][1])
        try:
            proc = subprocess.Popen(  # noqa: S603 - argv built by the backend, no shell input
                list(argv),
                stdin=child_ends[0],
                stdout=child_ends[1],
                stderr=child_ends[2],
                pass_fds=tuple(pass_fds),
                env=env,
                cwd="/",
                start_new_session=True,
            )
        except BaseException:
            for pair in ends:
                for fd in pair:
                    os.close(fd)
            raise
        for fd in child_ends:
            os.close(fd)
        self._stdin = ends[0][1]
        os.set_blocking(self._stdin, False)
        for number, (read_end, _) in ((1, ends[1]), (2, ends[2])):
            os.set_blocking(read_end, False)
            self._open[read_end] = number
            self._loop.add_reader(read_end, self._on_readable, read_end)
        return proc

    # -- output -----------------------------------------------------------------------------
    def _on_readable(self, fd: int) -> None:
        try:
            data = os.read(fd, CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close_output(fd)
            return
        buffer = self.streams[self._open[fd]]
        room = self.limit - len(buffer)
        if len(data) > room:
            self.truncated = True
        if room > 0:
            buffer += data[:room]

    def _close_output(self, fd: int) -> None:
        self._loop.remove_reader(fd)
        del self._open[fd]
        os.close(fd)
        if not self._open and not self.closed.done():
            self.closed.set_result(None)

    # -- input ------------------------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        """Write ``data`` to stdin, then close it (EOF), without blocking the loop; what a
        child never reads is dropped when it exits."""
        self._feeding = self._loop.create_task(self._feed(data))

    async def _feed(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view and self._stdin is not None:
                try:
                    view = view[os.write(self._stdin, view[:CHUNK]) :]
                except BlockingIOError:
                    await self._writable(self._stdin)
        except BrokenPipeError:
            pass  # the child stopped reading (or exited): the rest is not wanted
        finally:
            self._close_stdin()

    async def _writable(self, fd: int) -> None:
        ready: asyncio.Future[None] = self._loop.create_future()

        def on_writable() -> None:
            if not ready.done():
                ready.set_result(None)

        self._loop.add_writer(fd, on_writable)
        self._writer = fd
        try:
            await ready
        finally:
            self._remove_writer()

    def _remove_writer(self) -> None:
        if self._writer is not None:
            self._loop.remove_writer(self._writer)
            self._writer = None

    def _close_stdin(self) -> None:
        """Idempotent, and all on the loop's thread: the writer callback goes before the fd,
        so a later owner of the same number is never touched."""
        self._remove_writer()
        if self._stdin is not None:
            fd, self._stdin = self._stdin, None
            os.close(fd)

    # -- exit -------------------------------------------------------------------------------
    def _watch_exit(self) -> None:
        try:
            pidfd = os.pidfd_open(self.pid)
        except OSError:  # no pidfds here (Linux < 5.3): a thread waits instead
            threading.Thread(target=self._wait_in_thread, daemon=True).start()
            return
        self._loop.add_reader(pidfd, self._on_pidfd, pidfd)

    def _on_pidfd(self, pidfd: int) -> None:
        self._loop.remove_reader(pidfd)
        os.close(pidfd)
        self._proc.wait()  # it has exited: reaps at once
        self._set_exited()

    def _wait_in_thread(self) -> None:
        self._proc.wait()
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self._loop.call_soon_threadsafe(self._set_exited)

    def _set_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)

    def close(self) -> None:
        """Release our ends of the pipes (output not yet read is dropped). The caller has
        waited for ``exited`` or killed the process tree first."""
        if self._feeding is not None and not self._feeding.done():
            self._feeding.cancel()
        self._close_stdin()
        for fd in list(self._open):
            self._close_output(fd)

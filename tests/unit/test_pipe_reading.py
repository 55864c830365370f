"""Reading bwrap's --info-fd and stderr pipes on the event loop (``local_launch._read_all``).

`serve` runs on uvloop, whose ``connect_read_pipe`` closes the pipe's fd twice (libuv and
the attached file object each close the same number; MagicStack/uvloop#763). If another
thread opened something in between, that second close took its descriptor away: under
load a sandbox start failed with "[Errno 9] Bad file descriptor" (the density bench, about
one fill in three). These tests open a descriptor right after the read, where the freed
number is handed out again, and check that nothing closes it behind our back.
"""

from __future__ import annotations

import asyncio
import gc
import os

import pytest

from ivy_sandbox.backends.local_launch import _read_all

pytestmark = [pytest.mark.asyncio, pytest.mark.both_loops]


async def _settle() -> None:
    """Let the loop run deferred close callbacks and the collector run finalizers."""
    for _ in range(5):
        await asyncio.sleep(0)
    gc.collect()
    await asyncio.sleep(0.01)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


async def assert_closed_exactly_once(fd: int) -> None:
    """``fd`` is closed now, and a descriptor that reuses its number stays open afterwards
    (a second close of the old one would take it away)."""
    assert not _is_open(fd)
    reused = os.open(os.devnull, os.O_RDONLY)  # the lowest free number: the one just closed
    try:
        await _settle()
        assert _is_open(reused)
    finally:
        os.close(reused)


async def test_reading_a_pipe_to_the_end_closes_its_fd_exactly_once() -> None:
    for _ in range(20):
        read_end, write_end = os.pipe()
        os.write(write_end, b'{"child-pid": 42}')
        os.close(write_end)
        assert await _read_all(read_end, 5.0) == b'{"child-pid": 42}'
        await assert_closed_exactly_once(read_end)


async def test_a_read_cut_short_by_its_deadline_returns_what_came_and_closes_once() -> None:
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, b"partial")
        assert await _read_all(read_end, 0.05) == b"partial"  # the writer never closed
        await assert_closed_exactly_once(read_end)
    finally:
        os.close(write_end)


async def test_a_cancelled_read_closes_its_fd_and_leaves_others_alone() -> None:
    read_end, write_end = os.pipe()
    try:
        task = asyncio.create_task(_read_all(read_end, 5.0))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await assert_closed_exactly_once(read_end)
    finally:
        os.close(write_end)


async def test_a_pipe_larger_than_one_read_is_read_whole() -> None:
    read_end, write_end = os.pipe()
    payload = os.urandom(50_000)  # fits the pipe buffer (64 KiB), needs several reads
    os.write(write_end, payload)
    os.close(write_end)
    assert await _read_all(read_end, 5.0) == payload

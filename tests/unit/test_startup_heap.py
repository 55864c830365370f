"""`serve` and `worker` freeze the start-up heap so full collections stay short."""

from __future__ import annotations

import gc

from ivy_sandbox.cli.server import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: tracked by the collector


def test_objects_alive_at_start_up_are_out_of_the_collectors_sight_afterwards() -> None:
    before = _Node()
    assert any(obj is before for obj in gc.get_objects())
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0
        assert not any(obj is before for obj in gc.get_objects())
        after = _Node()
        assert any(obj is after for obj in gc.get_objects())  # later objects are collected
    finally:
        gc.unfreeze()

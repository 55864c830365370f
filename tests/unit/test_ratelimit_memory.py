"""The in-process sliding-window counters decide exactly as `limits`' own implementation."""

from __future__ import annotations

import random
import time

import pytest
from limits import parse
from limits.storage import MemoryStorage
from limits.strategies import SlidingWindowCounterRateLimiter

from ivy_sandbox.ratelimit_memory import InProcessStorage, SlidingWindows


class SteppedClock:
    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("seed", range(6))
def test_hits_and_remaining_match_the_limits_library_step_by_step(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(seed)
    amount, expiry = rng.choice([(3, 1), (5, 2), (10, 60), (1, 5)])
    clock = SteppedClock(1_700_000_000.0 + rng.random() * expiry)
    monkeypatch.setattr(time, "time", clock)  # what limits reads
    reference = SlidingWindowCounterRateLimiter(MemoryStorage())
    item = parse(f"{amount}/{expiry} second")
    ours = SlidingWindows(amount, expiry, clock)
    allowed = refused = 0
    for _ in range(400):
        steps = [0.0] * 6 + [0.001 * expiry, expiry * 0.1, expiry * 0.45, expiry * 1.3, expiry * 3]
        clock.now += rng.choice(steps)
        who = (rng.choice(["u1", "u2"]),)
        expected = reference.hit(item, *who)
        assert ours.hit(who) is expected
        allowed, refused = allowed + expected, refused + (not expected)
        stats = reference.get_window_stats(item, *who)
        assert ours.stats(who).remaining == stats.remaining
        if not expected:
            assert ours.stats(who).reset_in == pytest.approx(stats.reset_time - clock.now, abs=1e-6)
    assert allowed
    assert refused


def test_a_key_is_refused_at_its_limit_and_allowed_again_as_the_window_slides() -> None:
    clock = SteppedClock(1_000.0)  # the start of a 10 s window
    windows = SlidingWindows(2, 10, clock)
    assert windows.hit(("a",))
    assert windows.hit(("a",))
    assert not windows.hit(("a",))
    assert windows.hit(("b",))  # other keys are not affected
    clock.now += 10  # next window: the previous 2 still weigh fully
    assert not windows.hit(("a",))
    clock.now += 5  # half of them has slid out
    assert windows.hit(("a",))


def test_stale_keys_are_dropped_so_memory_stays_bounded() -> None:
    clock = SteppedClock(0.0)
    windows = SlidingWindows(100, 1, clock)
    for n in range(1000):
        windows.hit((str(n),))
    assert len(windows) == 1000
    clock.now += 2.5  # two windows later no old entry carries weight
    windows.hit(("new",))
    assert len(windows) == 1


def test_policies_get_their_own_counters_and_a_reset_forgets_them() -> None:
    storage = InProcessStorage()
    user, chat = storage.windows("user", 1, 60), storage.windows("chat", 1, 60)
    assert user.hit(("x",))
    assert chat.hit(("x",))
    assert storage.windows("user", 1, 60) is user
    storage.reset()
    assert storage.windows("user", 1, 60).hit(("x",))

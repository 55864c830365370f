"""Hand-written test doubles (named as such; never shipped as a user choice)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta


class FakeClock:
    """A clock that only moves when a test says so."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start or datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
        self._monotonic = 1000.0

    def now(self) -> datetime:
        return self._now

    def monotonic(self) -> float:
        return self._monotonic

    def time(self) -> float:
        return self._now.timestamp()

    def advance(self, seconds: float) -> None:
        self._now += timedelta(seconds=seconds)
        self._monotonic += seconds


class WallClock:
    """The real clock, with the ``time()`` the token factory needs (for engine tests)."""

    def now(self) -> datetime:
        return datetime.now(UTC)

    def monotonic(self) -> float:
        import time

        return time.monotonic()

    def time(self) -> float:
        import time

        return time.time()

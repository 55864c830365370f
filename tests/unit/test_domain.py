"""Pure domain rules: the status body, the ETA countdown, accepted ids."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from ivy_sandbox.domain.ids import is_acceptable_id, new_id
from ivy_sandbox.domain.sandbox import (
    Phase,
    SandboxSnapshot,
    SandboxStatus,
    remaining_eta,
    rfc3339,
    status_body,
)

T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)


def snapshot(status: SandboxStatus, phase: Phase, **fields: object) -> SandboxSnapshot:
    return SandboxSnapshot(status, phase, created_at=T0, phase_started_at=T0, **fields)  # type: ignore[arg-type]


def test_no_sandbox_is_status_none_and_nothing_else() -> None:
    assert status_body(None, T0) == {"status": "none"}


def test_failed_without_a_stored_message_still_reports_an_error_message() -> None:
    body = status_body(snapshot(SandboxStatus.FAILED, Phase.FAILED), T0)
    assert body["errorMessage"]


def test_eta_is_only_reported_while_provisioning() -> None:
    for status, phase in (
        (SandboxStatus.ACTIVE, Phase.READY),
        (SandboxStatus.FAILED, Phase.FAILED),
    ):
        assert "etaSeconds" not in status_body(snapshot(status, phase, eta_seconds=9), T0)


@given(
    eta=st.integers(min_value=0, max_value=3600),
    elapsed=st.floats(min_value=-5, max_value=10_000, allow_nan=False),
)
def test_eta_counts_down_is_an_integer_and_never_negative(eta: int, elapsed: float) -> None:
    snap = snapshot(SandboxStatus.PROVISIONING, Phase.COMPUTE, eta_seconds=eta)
    remaining = remaining_eta(snap, T0 + timedelta(seconds=elapsed))
    assert isinstance(remaining, int)
    assert 0 <= remaining <= eta
    later = remaining_eta(snap, T0 + timedelta(seconds=elapsed + 1))
    assert later is not None
    assert later <= remaining


def test_rfc3339_is_utc_with_milliseconds_and_z() -> None:
    assert rfc3339(datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)) == "2026-01-02T03:04:05.678Z"


def test_generated_ids_are_acceptable_and_junk_is_not() -> None:
    assert is_acceptable_id(new_id("chat"))
    for junk in ("", "-x", "a b", "a/b", "a" * 65, "ü", "a\n"):
        assert not is_acceptable_id(junk)

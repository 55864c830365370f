"""The ETA estimator (domain/eta.py): priors, the warm-up average, then a moving average."""

from __future__ import annotations

import pytest

from ivy_sandbox.domain.eta import (
    DEFAULT_PRIORS,
    EWMA_ALPHA,
    PRIORS,
    WARMUP_SAMPLES,
    PhaseStat,
    observe,
    prior,
    seconds_until_ready,
)
from ivy_sandbox.domain.sandbox import Phase


def test_priors_are_per_backend_and_an_unknown_backend_gets_the_defaults() -> None:
    assert prior("local", Phase.COMPUTE) == PRIORS["local"][Phase.COMPUTE]
    assert prior("some-new-backend", Phase.MOUNT) == DEFAULT_PRIORS[Phase.MOUNT]


def test_the_first_launch_moves_the_estimate_halfway_from_the_prior() -> None:
    first = observe("local", Phase.COMPUTE, None, 1.0)
    assert first == PhaseStat(samples=1, mean_seconds=(PRIORS["local"][Phase.COMPUTE] + 1.0) / 2)


def test_during_warm_up_the_prior_counts_as_one_sample_of_a_plain_average() -> None:
    stat = None
    for _ in range(WARMUP_SAMPLES):
        stat = observe("local", Phase.MOUNT, stat, 3.0)
    assert stat is not None
    assert stat.samples == WARMUP_SAMPLES
    expected = (PRIORS["local"][Phase.MOUNT] + 3.0 * WARMUP_SAMPLES) / (WARMUP_SAMPLES + 1)
    assert stat.mean_seconds == pytest.approx(expected)


def test_after_warm_up_a_moving_average_follows_drift() -> None:
    warm = PhaseStat(samples=WARMUP_SAMPLES, mean_seconds=2.0)
    after = observe("local", Phase.READY, warm, 4.0)
    assert after.mean_seconds == pytest.approx(2.0 + EWMA_ALPHA * (4.0 - 2.0))
    stat = after
    for _ in range(60):  # the phase got slower for good: the estimate converges to it
        stat = observe("local", Phase.READY, stat, 4.0)
    assert stat.mean_seconds == pytest.approx(4.0, rel=0.01)


def test_a_negative_duration_counts_as_zero() -> None:
    assert observe("local", Phase.READY, PhaseStat(10, 1.0), -5.0).mean_seconds == pytest.approx(
        1.0 - EWMA_ALPHA
    )


def test_seconds_until_ready_adds_this_phase_and_the_later_ones_from_stats_or_priors() -> None:
    stats = {Phase.COMPUTE: PhaseStat(3, 1.5), Phase.READY: PhaseStat(3, 0.25)}
    mount_prior = PRIORS["local"][Phase.MOUNT]
    assert seconds_until_ready("local", Phase.COMPUTE, stats) == pytest.approx(
        1.5 + mount_prior + 0.25
    )
    assert seconds_until_ready("local", Phase.MOUNT, stats) == pytest.approx(mount_prior + 0.25)
    assert seconds_until_ready("local", Phase.READY, stats) == pytest.approx(0.25)
    assert seconds_until_ready("local", Phase.FAILED, stats) == 0.0

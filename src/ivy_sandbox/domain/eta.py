"""ETA: how long a launch still needs, learned from past launches on the same backend.

Per backend and phase we keep a running mean of how long the phase took. The first
``WARMUP_SAMPLES`` observations are averaged together with the prior (so one odd launch does
not swing the estimate); after that an exponentially weighted mean follows drift.

The estimate is made once, when a phase starts: "seconds until ready" = the mean of this phase
plus the means of the phases after it. The status endpoint then counts it down with elapsed
time (see :func:`ivy_sandbox.domain.sandbox.remaining_eta`), so within a phase it never jumps
up; it stops at 0 if a phase overruns, and is re-estimated at the next phase.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ivy_sandbox.domain.sandbox import Phase

LAUNCH_PHASES: tuple[Phase, ...] = (Phase.COMPUTE, Phase.MOUNT, Phase.READY)
WARMUP_SAMPLES = 5
EWMA_ALPHA = 0.2

# Before any history: what a phase usually costs on each backend (seconds).
PRIORS: dict[str, dict[Phase, float]] = {
    "local": {Phase.COMPUTE: 0.2, Phase.MOUNT: 0.1, Phase.READY: 0.1},
    "kubernetes": {Phase.COMPUTE: 8.0, Phase.MOUNT: 4.0, Phase.READY: 2.0},
}
DEFAULT_PRIORS: dict[Phase, float] = {Phase.COMPUTE: 5.0, Phase.MOUNT: 3.0, Phase.READY: 2.0}


@dataclass(frozen=True, slots=True)
class PhaseStat:
    samples: int
    mean_seconds: float


def prior(backend: str, phase: Phase) -> float:
    return PRIORS.get(backend, DEFAULT_PRIORS).get(phase, DEFAULT_PRIORS[phase])


def expected(backend: str, phase: Phase, stats: Mapping[Phase, PhaseStat]) -> float:
    stat = stats.get(phase)
    return stat.mean_seconds if stat is not None else prior(backend, phase)


def seconds_until_ready(backend: str, phase: Phase, stats: Mapping[Phase, PhaseStat]) -> float:
    """Expected seconds from the start of ``phase`` until the sandbox is active."""
    if phase not in LAUNCH_PHASES:
        return 0.0
    remaining = LAUNCH_PHASES[LAUNCH_PHASES.index(phase) :]
    return sum(expected(backend, p, stats) for p in remaining)


def observe(backend: str, phase: Phase, stat: PhaseStat | None, seconds: float) -> PhaseStat:
    """The statistic after one more observed duration of ``phase``."""
    seconds = max(0.0, seconds)
    if stat is None:
        stat = PhaseStat(samples=0, mean_seconds=prior(backend, phase))
    if stat.samples < WARMUP_SAMPLES:
        # The prior counts as one sample, so the first real launch moves the mean halfway.
        weight = stat.samples + 1
        mean = (stat.mean_seconds * weight + seconds) / (weight + 1)
    else:
        mean = stat.mean_seconds + EWMA_ALPHA * (seconds - stat.mean_seconds)
    return PhaseStat(samples=stat.samples + 1, mean_seconds=mean)

"""Prometheus metrics of this process, in one registry served at ``/metrics``.

Counters and histograms are process-wide (the usual Prometheus model: scrape every process);
the sandbox gauges are read from the database at scrape time, so every replica reports the
same truth.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

HTTP_REQUESTS = Counter(
    "ivy_http_requests_total",
    "HTTP requests answered, by route template, method and status code.",
    ["route", "method", "code"],
    registry=REGISTRY,
)
HTTP_LATENCY = Histogram(
    "ivy_http_request_duration_seconds",
    "Time to answer (first byte of the response), by route template.",
    ["route"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 60),
    registry=REGISTRY,
)
RATE_LIMITED = Counter(
    "ivy_rate_limited_total",
    "Requests refused with 429, by rate-limit policy.",
    ["policy"],
    registry=REGISTRY,
)
AUTH_FAILURES = Counter(
    "ivy_auth_failures_total",
    "Requests refused with 401.",
    registry=REGISTRY,
)
LAUNCHES = Counter(
    "ivy_launches_total",
    "Launches driven to an end by this process, by outcome and errorCode.",
    ["outcome", "error_code"],
    registry=REGISTRY,
)
PHASE_DURATION = Histogram(
    "ivy_phase_duration_seconds",
    "Duration of each completed launch phase, by backend and phase.",
    ["backend", "phase"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
    registry=REGISTRY,
)
SANDBOXES = Gauge(
    "ivy_sandboxes",
    "Sandboxes by status, read from the database at scrape time.",
    ["status"],
    registry=REGISTRY,
)

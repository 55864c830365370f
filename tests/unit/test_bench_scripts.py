"""The benchmark scripts (bench/): each one starts, documents its options, and promises the JSON
keys issue 5 lists. Running them is not a test (they take minutes and need wrk)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"

# The keys issue 5 requires in each script's JSON.
REQUIRED_KEYS = {
    "status_poll": [
        "ours_rps",
        "fastapi_constant_rps",
        "bare_asgi_rps",
        "ratio_vs_fastapi",
        "ratio_vs_bare_asgi",
        "p50_ms",
        "p99_ms",
        "jwt_rps",
        "ratio_jwt_vs_key",
        "cookie_rps",
    ],
    "launch": ["p50_ms", "p99_ms", "p50_ms_c20", "p99_ms_c20"],
    "watch_latency": ["sse_p50_ms", "sse_p99_ms", "longpoll_p50_ms", "longpoll_p99_ms"],
    "eta": ["mae_fraction", "max_upward_jump_s"],
    "density": ["sandboxes", "mb_per_sandbox", "status_p99_ms"],
}
USES_WRK = ("status_poll", "density")


def load(name: str) -> ModuleType:
    saved = list(sys.path)
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path[:] = saved


@pytest.mark.parametrize("name", sorted(REQUIRED_KEYS))
def test_help_works(name: str) -> None:
    result = subprocess.run(
        [sys.executable, str(BENCH / f"{name}.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "--quick" in result.stdout
    assert "--json-out" in result.stdout


@pytest.mark.parametrize("name", sorted(REQUIRED_KEYS))
def test_promised_keys_match_the_issue(name: str) -> None:
    module = load(name)
    assert set(REQUIRED_KEYS[name]) <= set(module.KEYS)
    assert name == module.NAME


@pytest.mark.parametrize("name", sorted(REQUIRED_KEYS))
def test_committed_results_have_the_keys(name: str) -> None:
    files = sorted((BENCH / "results").glob(f"{name}*.json"))
    if not files:
        pytest.skip(f"no committed result for {name}")
    for path in files:
        data = json.loads(path.read_text())
        missing = [key for key in REQUIRED_KEYS[name] if key not in data]
        assert not missing, f"{path.name} lacks {missing}"


@pytest.mark.parametrize("name", sorted(REQUIRED_KEYS))
def test_committed_results_say_by_how_much_and_why_each_missed_goal_was_missed(
    name: str,
) -> None:
    path = BENCH / "results" / f"{name}.json"
    if not path.exists():
        pytest.skip(f"no committed result for {name}")
    data = json.loads(path.read_text())
    missed = [goal for goal, met in data["goals"].items() if not met]
    assert sorted(data["gaps"]) == sorted(missed)
    assert all(data["gaps"][goal]["why"] for goal in missed)


@pytest.mark.parametrize("name", USES_WRK)
def test_missing_wrk_says_how_to_install_it(name: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(BENCH / f"{name}.py"), "--json-out", str(tmp_path / "x.json")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PATH": str(tmp_path)},  # no wrk (nor anything else) on PATH
    )
    assert result.returncode != 0
    assert "apt-get install -y wrk" in result.stderr
    assert not (tmp_path / "x.json").exists()


def test_wrk_output_parser_and_percentiles() -> None:
    common = load("_common")
    assert common.percentile([1, 2, 3, 4], 50) == 2.5
    assert common.percentile([5], 99) == 5
    assert common.sandbox_cgroup_prefix(Path("/data")).startswith("ivy-")
    assert "done = function" in common.DONE_LUA


# -- bench/soak.py (issue 6: the long soak) ---------------------------------------------------
SOAK_KEYS = [
    "passed",
    "failures",
    "server_5xx",
    "rss_growth_mb",
    "fd_growth",
    "thread_growth",
    "poll_p99_ms",
    "samples",
]


def test_soak_starts_documents_its_options_and_promises_its_keys() -> None:
    result = subprocess.run(
        [sys.executable, str(BENCH / "soak.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    for option in ("--quick", "--json-out", "--duration", "--backend"):
        assert option in result.stdout
    module = load("soak")
    assert module.NAME == "soak"
    assert set(SOAK_KEYS) <= set(module.KEYS)


def test_soak_judges_growth_from_the_second_sample_to_the_last() -> None:
    soak = load("soak")

    def sample(t: float, rss: float, fds: int, threads: int) -> dict[str, float]:
        return {"t_s": t, "rss_mb": rss, "fds": fds, "threads": threads}

    warm_up = sample(60, 40, 20, 5)  # start-up growth before the second sample is ignored
    steady = [warm_up, sample(120, 110, 40, 12), sample(180, 130, 50, 12)]
    growth, failures = soak.judge_growth(steady)
    assert growth == {"rss_mb": 20, "fds": 10, "threads": 0}
    assert failures == []
    leaking = [*steady, sample(240, 200, 150, 30)]
    _, failures = soak.judge_growth(leaking)
    assert len(failures) == 3
    assert any(f.startswith("rss_mb grew by 90") for f in failures)
    _, failures = soak.judge_growth([warm_up])
    assert failures  # too short to judge is a failure, not a pass


def test_soak_counts_5xx_from_metrics_whose_labels_hold_braces() -> None:
    soak = load("soak")
    text = "\n".join(
        [
            "# HELP ivy_http_requests_total HTTP requests answered",
            'ivy_http_requests_total{code="200",method="GET",route="/v1/sandbox/{chatId}/status"}'
            " 250.0",
            'ivy_http_requests_total{code="503",method="GET",route="/v1/sandbox/{chatId}"} 2.0',
            'ivy_http_requests_total{code="500",method="POST",route="/v1/chats"} 1.0',
            'ivy_rate_limited_total{policy="per_user"} 7.0',
            "ivy_auth_failures_total 3.0",
        ]
    )
    totals = soak.metric_totals(text)
    assert totals["http_2xx"] == 250
    assert totals["http_5xx"] == 3
    assert totals["rate_limited"] == 7
    assert totals["auth_failures"] == 3

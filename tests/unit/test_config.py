"""Settings from the environment (ivy_sandbox.config): defaults, one-line errors, the pepper."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from sqlalchemy.engine import make_url

from ivy_sandbox import config
from ivy_sandbox.config import (
    PEPPER_FILE,
    Settings,
    api_key_pepper,
    ensure_data_dir,
    load_settings,
)
from ivy_sandbox.errors import ConfigurationError

PUBLIC_PEM = (
    rsa.generate_private_key(public_exponent=65537, key_size=2048)
    .public_key()
    .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    .decode()
)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No IVY_* variable leaks in from the caller, and relative paths land in tmp_path."""
    for name in list(os.environ):
        if name.upper().startswith("IVY_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


def config_error(monkeypatch: pytest.MonkeyPatch, **env: str) -> str:
    """The ConfigurationError message ``load_settings`` raises with ``env`` set."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigurationError) as info:
        load_settings()
    return str(info.value)


# -- defaults ----------------------------------------------------------------------------------
def test_defaults_without_any_ivy_variable() -> None:
    settings = load_settings()
    assert settings.data_dir == Path("./.ivy-sandbox")
    assert settings.database_url is None
    assert settings.redis_url is None
    assert settings.api_key_pepper is None
    assert settings.clerk_jwt_key is None
    assert settings.clerk_jwks_url is None
    assert settings.clerk_issuer is None
    assert settings.clerk_authorized_parties == frozenset()
    assert not settings.clerk_configured
    assert (settings.rate_limit, settings.rate_limit_per_chat, settings.auth_failure_limit) == (
        "600/minute",
        "120/minute",
        "60/minute",
    )


def test_settings_are_read_from_ivy_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IVY_DATA_DIR", "/srv/ivy")
    monkeypatch.setenv("IVY_DATABASE_URL", "postgresql+asyncpg://ivy@db/ivy")
    monkeypatch.setenv("IVY_REDIS_URL", "redis://cache:6379/0")
    monkeypatch.setenv("IVY_CLERK_JWKS_URL", "https://clerk.example/.well-known/jwks.json")
    monkeypatch.setenv("IVY_CLERK_ISSUER", "https://clerk.example")
    monkeypatch.setenv("IVY_RATE_LIMIT", "100/second")
    monkeypatch.setenv("IVY_RATE_LIMIT_PER_CHAT", "5 per second")
    monkeypatch.setenv("IVY_AUTH_FAILURE_LIMIT", "10/hour")
    settings = load_settings()
    assert settings.data_dir == Path("/srv/ivy")
    assert settings.effective_database_url == "postgresql+asyncpg://ivy@db/ivy"
    assert settings.redis_url == "redis://cache:6379/0"
    assert settings.clerk_configured
    assert settings.clerk_issuer == "https://clerk.example"
    assert (settings.rate_limit, settings.rate_limit_per_chat, settings.auth_failure_limit) == (
        "100/second",
        "5 per second",
        "10/hour",
    )


def test_empty_optional_urls_mean_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IVY_DATABASE_URL", "")
    monkeypatch.setenv("IVY_REDIS_URL", "")
    monkeypatch.setenv("IVY_CLERK_JWT_KEY", "  ")
    settings = load_settings()
    assert (settings.database_url, settings.redis_url, settings.clerk_jwt_key) == (None,) * 3


def test_settings_are_not_read_at_import_but_when_built(monkeypatch: pytest.MonkeyPatch) -> None:
    first = load_settings()
    monkeypatch.setenv("IVY_RATE_LIMIT", "7/minute")
    assert first.rate_limit == "600/minute"
    assert load_settings().rate_limit == "7/minute"


# -- one clear line per bad setting ------------------------------------------------------------
BAD_SETTINGS = [
    ("IVY_RATE_LIMIT", "lots"),
    ("IVY_RATE_LIMIT", "600/minute;10/second"),
    ("IVY_RATE_LIMIT_PER_CHAT", "120/fortnight"),
    ("IVY_RATE_LIMIT_PER_CHAT", ""),
    ("IVY_AUTH_FAILURE_LIMIT", "-1/minute"),
    ("IVY_DATABASE_URL", "mysql://ivy@db/ivy"),
    ("IVY_DATABASE_URL", "postgresql://ivy@db/ivy"),  # sync driver: not supported
    ("IVY_DATABASE_URL", "sqlite:///ivy.db"),
    ("IVY_REDIS_URL", "http://cache:6379"),
    ("IVY_REDIS_URL", "cache:6379"),
    ("IVY_CLERK_JWT_KEY", "not a key"),
    ("IVY_CLERK_JWKS_URL", "not a url"),
    ("IVY_CLERK_JWKS_URL", "clerk.example/.well-known/jwks.json"),
    ("IVY_CLERK_JWKS_URL", "ftp://clerk.example/jwks.json"),
    ("IVY_CLERK_JWT_KEY", "-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----"),
]


@pytest.mark.parametrize(("variable", "value"), BAD_SETTINGS)
def test_a_bad_setting_is_one_configuration_error_line_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    message = config_error(monkeypatch, **{variable: value})
    assert message.startswith(f"{variable}: "), message
    assert "\n" not in message
    assert len(message) > len(variable) + 5  # says what is wrong, not just the name
    if variable == "IVY_CLERK_JWT_KEY":
        assert "MIIE" not in message  # never echo key material


@pytest.mark.parametrize("variable", ["IVY_RATE_LIMIT", "IVY_RATE_LIMIT_PER_CHAT"])
def test_a_zero_rate_limit_is_rejected(monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    assert config_error(monkeypatch, **{variable: "0/minute"}).startswith(f"{variable}: ")


def test_a_keepalive_interval_above_the_promised_15_seconds_is_rejected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    message = config_error(monkeypatch, IVY_WATCH_KEEPALIVE_SECONDS="16")
    assert message.startswith("IVY_WATCH_KEEPALIVE_SECONDS: "), message
    assert "15" in message  # says what the limit is


@pytest.mark.parametrize("value", ["15", "0.1"])
def test_keepalive_intervals_up_to_15_seconds_are_accepted(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("IVY_WATCH_KEEPALIVE_SECONDS", value)
    assert load_settings().watch_keepalive_seconds == float(value)


def test_two_bad_settings_still_give_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    message = config_error(monkeypatch, IVY_RATE_LIMIT="lots", IVY_REDIS_URL="http://x")
    assert "\n" not in message
    assert message.startswith(("IVY_RATE_LIMIT: ", "IVY_REDIS_URL: "))


def test_configuration_error_hides_the_validation_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("IVY_REDIS_URL", "http://x")
    with pytest.raises(ConfigurationError) as info:
        load_settings()
    assert info.value.__suppress_context__
    assert info.value.__cause__ is None


def test_unusable_data_dir_is_a_configuration_error_naming_ivy_data_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigurationError, match=r"^IVY_DATA_DIR: "):
        ensure_data_dir(Settings(data_dir=blocker / "sub"))


# -- clerk -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (" https://a.example , https://b.example,,  ", {"https://a.example", "https://b.example"}),
        ("https://only.example", {"https://only.example"}),
        ('["https://a.example"]', {'["https://a.example"]'}),  # a comma list, never JSON
        ("", set()),
    ],
)
def test_authorized_parties_is_a_comma_list_with_spaces_trimmed(
    monkeypatch: pytest.MonkeyPatch, raw: str, expected: set[str]
) -> None:
    monkeypatch.setenv("IVY_CLERK_AUTHORIZED_PARTIES", raw)
    parties = load_settings().clerk_authorized_parties
    assert isinstance(parties, frozenset)
    assert parties == expected


def test_pem_with_literal_backslash_n_is_accepted_as_real_newlines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("IVY_CLERK_JWT_KEY", PUBLIC_PEM.strip().replace("\n", "\\n"))
    settings = load_settings()
    assert settings.clerk_jwt_key == PUBLIC_PEM.strip()
    assert settings.clerk_configured
    assert serialization.load_pem_public_key(settings.clerk_jwt_key.encode())


def test_pem_with_real_newlines_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IVY_CLERK_JWT_KEY", PUBLIC_PEM)
    assert load_settings().clerk_jwt_key == PUBLIC_PEM.strip()


def test_secrets_are_not_in_the_settings_repr(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IVY_API_KEY_PEPPER", "s3cret-pepper")
    monkeypatch.setenv("IVY_CLERK_JWT_KEY", PUBLIC_PEM)
    text = repr(load_settings())
    assert "s3cret-pepper" not in text
    assert "BEGIN PUBLIC KEY" not in text


# -- database URL ------------------------------------------------------------------------------
def test_default_database_is_a_sqlite_file_in_the_data_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("IVY_DATA_DIR", str(tmp_path / "data"))
    url = make_url(load_settings().effective_database_url)
    assert url.drivername == "sqlite+aiosqlite"
    assert Path(url.database or "") == (tmp_path / "data" / "ivy-sandbox.db").resolve()


def test_default_database_path_is_absolute_even_for_the_relative_default_data_dir(
    tmp_path: Path,
) -> None:
    url = make_url(load_settings().effective_database_url)
    path = Path(url.database or "")
    assert path.is_absolute()
    assert path == (tmp_path / ".ivy-sandbox" / "ivy-sandbox.db").resolve()


# -- the API key pepper ------------------------------------------------------------------------
def test_pepper_is_generated_once_and_kept_private(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "new" / "dir")
    first = api_key_pepper(settings)
    assert len(first) >= 32
    assert api_key_pepper(settings) == first
    assert api_key_pepper(Settings(data_dir=tmp_path / "new" / "dir")) == first
    path = tmp_path / "new" / "dir" / PEPPER_FILE
    assert path.read_text().strip().encode() == first
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_each_data_dir_gets_its_own_pepper(tmp_path: Path) -> None:
    one = api_key_pepper(Settings(data_dir=tmp_path / "a"))
    two = api_key_pepper(Settings(data_dir=tmp_path / "b"))
    assert one != two


def test_pepper_setting_overrides_the_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / PEPPER_FILE).write_text("from-the-file\n")
    monkeypatch.setenv("IVY_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("IVY_API_KEY_PEPPER", "from-the-setting")
    assert api_key_pepper(load_settings()) == b"from-the-setting"
    assert (tmp_path / PEPPER_FILE).read_text() == "from-the-file\n"


def test_pepper_setting_creates_no_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("IVY_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("IVY_API_KEY_PEPPER", "from-the-setting")
    assert api_key_pepper(load_settings()) == b"from-the-setting"
    assert not (tmp_path / "data" / PEPPER_FILE).exists()


def test_existing_pepper_file_is_read_not_replaced(tmp_path: Path) -> None:
    (tmp_path / PEPPER_FILE).write_text("kept\n")
    assert api_key_pepper(Settings(data_dir=tmp_path)) == b"kept"


def test_empty_pepper_file_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(config.time, "sleep", lambda _seconds: None)
    (tmp_path / PEPPER_FILE).write_text("")
    with pytest.raises(ConfigurationError, match=r"^IVY_API_KEY_PEPPER: "):
        api_key_pepper(Settings(data_dir=tmp_path))


PEPPER_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from ivy_sandbox.config import Settings, api_key_pepper

    go = Path(sys.argv[2])
    while not go.exists():
        time.sleep(0.001)
    print(api_key_pepper(Settings(data_dir=sys.argv[1])).decode())
    """
)


def test_concurrent_first_calls_from_several_processes_agree_on_one_pepper(
    tmp_path: Path,
) -> None:
    data_dir, go = tmp_path / "shared", tmp_path / "go"
    env = {k: v for k, v in os.environ.items() if not k.startswith("IVY_")}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", PEPPER_SCRIPT, str(data_dir), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(8)
    ]
    time.sleep(0.5)  # let them all import and wait at the starting line
    go.touch()
    results = [p.communicate(timeout=30) for p in processes]
    assert all(p.returncode == 0 for p in processes), [err for _, err in results]
    peppers = {out.strip() for out, _ in results}
    assert len(peppers) == 1
    assert peppers == {(data_dir / PEPPER_FILE).read_text().strip()}
    assert peppers != {""}

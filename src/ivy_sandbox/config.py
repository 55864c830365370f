"""Settings: one pydantic-settings class, built by the factory (never at import time).

Every variable has the prefix ``IVY_``. :func:`load_settings` turns a validation failure into
one :class:`~ivy_sandbox.errors.ConfigurationError` line that names the variable, so a bad
setting stops start-up clearly instead of with a traceback.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from limits import parse_many
from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from ivy_sandbox.errors import ConfigurationError

PEPPER_FILE = "api-key-pepper"


_SIZE_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}


def parse_size(value: str) -> int:
    """``512M`` → bytes (K, M, G are powers of 1024; a bare number is bytes)."""
    text = value.strip().upper().removesuffix("B").removesuffix("I")
    unit = text[-1:] if text[-1:] in _SIZE_UNITS else ""
    number = text[: len(text) - len(unit)]
    try:
        size = int(float(number) * _SIZE_UNITS[unit])
    except ValueError:
        raise ValueError(f"not a size like 512M or 2G: {value!r}") from None
    if size < 16 * 1024 * 1024:
        raise ValueError("must be at least 16M")
    return size


def _check_rate_limit(value: str) -> str:
    try:
        parsed = parse_many(value)
    except ValueError as exc:
        raise ValueError(f"not a rate limit in `limits` notation (e.g. 600/minute): {exc}") from exc
    if len(parsed) != 1:
        raise ValueError("give exactly one rate limit, e.g. 600/minute")
    if parsed[0].amount < 1:
        raise ValueError("must allow at least one request per window")
    return value


class Settings(BaseSettings):
    """All configuration of the service; see the README's configuration table."""

    model_config = SettingsConfigDict(env_prefix="IVY_", extra="ignore", frozen=True)

    data_dir: Path = Path("./.ivy-sandbox")
    database_url: str | None = None
    redis_url: str | None = None

    api_key_pepper: str | None = Field(default=None, repr=False)

    clerk_jwt_key: str | None = Field(default=None, repr=False)
    clerk_jwks_url: str | None = None
    clerk_issuer: str | None = None
    clerk_authorized_parties: Annotated[frozenset[str], NoDecode] = frozenset()

    rate_limit: str = "600/minute"
    rate_limit_per_chat: str = "120/minute"
    auth_failure_limit: str = "60/minute"
    rate_limit_launch: str = "30/minute"

    # Sandboxes (issue: lifecycle). Times are seconds.
    sandbox_backend: Literal["local", "latency-fake"] = "local"
    sandbox_network: bool = False
    max_sandboxes: int = Field(default=50, ge=1)
    sandbox_idle_timeout: float = Field(default=900.0, gt=0)
    capacity_timeout: float = Field(default=300.0, gt=0)
    compute_timeout: float = Field(default=60.0, gt=0)
    mount_timeout: float = Field(default=30.0, gt=0)
    ready_timeout: float = Field(default=30.0, gt=0)
    sandbox_memory: str = "512M"
    sandbox_pids: int = Field(default=256, ge=8)
    # Size of each chat's workspace (local backend: a loop-mounted ext4 image; needs root and
    # loop devices, else reported "not enforced" at start-up); "off" for no limit.
    sandbox_disk: str = "1G"
    sandbox_cpus: float = Field(default=1.0, gt=0)
    exec_output_limit: int = Field(default=1024 * 1024, ge=1024)
    exec_max_timeout: float = Field(default=3600.0, gt=0)
    max_request_bytes: int = Field(default=2 * 1024 * 1024, ge=1024)
    max_header_bytes: int = Field(default=16 * 1024, ge=4096)
    log_format: Literal["json", "text"] = "json"
    # One line per request costs ~30 % of the hot path's throughput; /metrics counts
    # requests anyway, and errors are logged with their request id either way.
    access_log: bool = False
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    metrics_token: str | None = Field(default=None, repr=False)
    run_worker: bool = True  # serve drives launches in-process; false when using `worker`
    # How often an open SSE stream sends a keep-alive comment, and how often it and a waiting
    # long-poll check their credential again (a revoked key ends them within this + 5 s).
    # At most 15 s: the events contract promises a keep-alive at least that often (proxies
    # and browsers drop a silent stream); small values are for tests.
    watch_keepalive_seconds: float = Field(default=15.0, ge=0.1, le=15.0)

    @field_validator("sandbox_memory")
    @classmethod
    def _memory_size(cls, value: str) -> str:
        parse_size(value)
        return value

    @property
    def sandbox_memory_bytes(self) -> int:
        return parse_size(self.sandbox_memory)

    @field_validator("sandbox_disk")
    @classmethod
    def _disk_size(cls, value: str) -> str:
        if value.strip().lower() != "off":
            parse_size(value)
        return value

    @property
    def sandbox_disk_bytes(self) -> int | None:
        """None when the limit is off."""
        return None if self.sandbox_disk.strip().lower() == "off" else parse_size(self.sandbox_disk)

    @field_validator("rate_limit", "rate_limit_per_chat", "auth_failure_limit", "rate_limit_launch")
    @classmethod
    def _valid_rate_limit(cls, value: str) -> str:
        return _check_rate_limit(value)

    @field_validator("clerk_jwks_url")
    @classmethod
    def _jwks_url(cls, value: str | None) -> str | None:
        """Checked at start-up: a typo here would otherwise surface as 401s for everyone."""
        if value is None:
            return None
        parsed = urlsplit(value.strip())
        if parsed.scheme not in ("https", "http") or not parsed.hostname:
            raise ValueError(
                "must be an http(s) URL, e.g. https://<your-app>.clerk.accounts.dev/.well-known/jwks.json"
            )
        return value.strip()

    @field_validator("clerk_authorized_parties", mode="before")
    @classmethod
    def _split_parties(cls, value: Any) -> Any:
        if isinstance(value, str):
            return frozenset(p.strip() for p in value.split(",") if p.strip())
        return value

    @field_validator("database_url")
    @classmethod
    def _supported_database(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        if not value.startswith(("sqlite+aiosqlite://", "postgresql+asyncpg://")):
            raise ValueError("must start with sqlite+aiosqlite:// or postgresql+asyncpg://")
        return value

    @field_validator("redis_url")
    @classmethod
    def _supported_redis(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        if not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix://")
        return value

    @field_validator("clerk_jwt_key")
    @classmethod
    def _pem_key(cls, value: str | None) -> str | None:
        if value is None or value.strip() == "":
            return None
        # Clerk's dashboard shows the key with literal "\n"; accept both forms.
        text = value.strip().replace("\\n", "\n")
        if "BEGIN PUBLIC KEY" not in text:
            raise ValueError("must be a PEM public key (-----BEGIN PUBLIC KEY-----)")
        return text

    @property
    def effective_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite+aiosqlite:///{(self.data_dir / 'ivy-sandbox.db').resolve()}"

    @property
    def clerk_configured(self) -> bool:
        return bool(self.clerk_jwt_key or self.clerk_jwks_url)


def load_settings(**overrides: Any) -> Settings:
    """Build settings from the environment, failing with one line that names the variable."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else "?"
        message = first["msg"].removeprefix("Value error, ")
        raise ConfigurationError(f"IVY_{field.upper()}: {message}") from None


def ensure_data_dir(settings: Settings) -> Path:
    path = settings.data_dir
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigurationError(f"IVY_DATA_DIR: cannot create {path}: {exc.strerror}") from None
    return path


def api_key_pepper(settings: Settings) -> bytes:
    """The HMAC pepper for API keys: the setting, or a secret generated once in the data dir.

    The file is created with O_EXCL so that `serve` and an admin command starting at the same
    moment agree on one pepper.
    """
    if settings.api_key_pepper:
        return settings.api_key_pepper.encode()
    path = ensure_data_dir(settings) / PEPPER_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    for _ in range(50):
        value = path.read_text().strip()
        if value:
            return value.encode()
        # Another process created the file and is about to write it.
        time.sleep(0.01)
    raise ConfigurationError(f"IVY_API_KEY_PEPPER: the pepper file {path} is empty")

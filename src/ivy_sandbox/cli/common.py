"""What every command shares: one-line errors, exit codes, settings, JSON output."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Coroutine
from typing import Annotated, Any, NoReturn, TypeVar

import typer

from ivy_sandbox.backends.base import BackendError
from ivy_sandbox.config import Settings, load_settings
from ivy_sandbox.errors import ApiError, ConfigurationError
from ivy_sandbox.storage.repository import Repository

T = TypeVar("T")

JsonFlag = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


def fail(message: str, code: int = 1) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def settings_or_exit() -> Settings:
    try:
        return load_settings()
    except ConfigurationError as exc:
        fail(str(exc), 2)


def run_with_repository(settings: Settings, use_case: Callable[[Repository], Awaitable[T]]) -> T:
    """Open the database (migrating if needed), run one use case, close, map errors to a line."""
    from ivy_sandbox.bootstrap import open_repository

    async def main() -> T:
        repository = await open_repository(settings)
        try:
            return await use_case(repository)
        finally:
            await repository.dispose()

    return run_or_fail(main())


def run_or_fail(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine``; turn every expected failure into one line on stderr."""
    try:
        return asyncio.run(coroutine)
    except ApiError as exc:
        fail(exc.detail)
    except ConfigurationError as exc:
        fail(str(exc), 2)
    except BackendError as exc:  # e.g. bubblewrap cannot run here: not a setting, but fatal
        fail(f"sandboxes cannot run on this host: {exc.message}", 2)
    except OSError as exc:
        fail(f"cannot reach the database: {exc.strerror or exc}")
    except Exception as exc:
        if type(exc).__module__.startswith("sqlalchemy"):
            fail(f"database error: {type(exc).__name__}: {getattr(exc, 'orig', exc)}")
        raise


def emit(value: str, as_json: bool, payload: dict[str, Any] | list[Any]) -> None:
    typer.echo(json.dumps(payload) if as_json else value)

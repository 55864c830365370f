"""Client commands: talk to a server over HTTP (IVY_API_URL + IVY_API_KEY) through the SDK."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from ivy_sandbox.cli.common import JsonFlag, fail
from ivy_sandbox.cli.progress import Display, display_for, status_json

T = TypeVar("T")


def _client() -> Any:
    from ivy_sandbox.client import Client, IvySandboxClientError

    try:
        return Client()
    except IvySandboxClientError as exc:
        fail(str(exc), 2)


def _client_call(call: Callable[[], T]) -> T:
    from ivy_sandbox.client import IvySandboxClientError, SandboxFailedError

    try:
        return call()
    except SandboxFailedError as exc:
        fail(f"{exc.error_code}: {exc.error_message}")
    except IvySandboxClientError as exc:
        fail(str(exc))


NO_SANDBOX_EXIT = 3  # --follow / --wait on a chat whose status is `none`

TimeoutOption = Annotated[
    float, typer.Option("--timeout", metavar="SECONDS", help="Give up waiting after SECONDS.")
]


def _watch(ivy: Any, chat_id: str, timeout: float, display: Display) -> dict[str, Any]:
    """Wait until active, showing progress on ``display``; on failure, one error line and
    exit 1 (``none``: exit 3). The display is closed before anything is printed after it."""
    from ivy_sandbox.client import IvySandboxClientError, NoSandboxError, SandboxFailedError

    problem: tuple[str, int] | None = None
    body: dict[str, Any] = {}
    with display:
        try:
            body = ivy.sandbox.wait_until_ready(
                chat_id, timeout=timeout, on_progress=display.update
            )
            display.done(body)
        except SandboxFailedError as exc:
            display.failed(exc.error_code, exc.error_message)
            problem = (f"{exc.error_code or 'failed'}: {exc.error_message}", 1)
        except NoSandboxError as exc:
            display.gave_up("no sandbox")
            problem = (str(exc), NO_SANDBOX_EXIT)
        except IvySandboxClientError as exc:
            display.gave_up("stopped waiting")
            problem = (str(exc), 1)
    if problem is not None:
        fail(*problem)
    return body


def launch(
    chat_id: Annotated[str, typer.Argument(metavar="CHAT_ID")],
    wait: Annotated[
        bool,
        typer.Option(
            "--wait",
            help="Wait until the sandbox is active, showing progress on stderr (live on a "
            "terminal); exit 1 if it fails.",
        ),
    ] = False,
    timeout: TimeoutOption = 300.0,
    as_json: JsonFlag = False,
) -> None:
    """Launch the chat's sandbox; prints its status (with --wait: `active`, or fails)."""
    with _client() as ivy:
        body = _client_call(lambda: ivy.sandbox.launch(chat_id))
        if wait and body.get("status") != "active":
            console = Console(stderr=True)
            display = display_for(stream=sys.stderr, console=console, json_lines=False)
            body = _watch(ivy, chat_id, timeout, display)
    emit_status(body, as_json)


def status(
    chat_id: Annotated[str, typer.Argument(metavar="CHAT_ID")],
    as_json: JsonFlag = False,
    follow: Annotated[
        bool,
        typer.Option(
            "--follow",
            "-f",
            help="Follow a launch until it ends: a live display on a terminal, else (or with "
            "--json) one JSON status body per change. Exit 0 when active, 1 when failed, "
            "3 when the chat has no sandbox.",
        ),
    ] = False,
    timeout: TimeoutOption = 300.0,
) -> None:
    """Print the sandbox status (`none`, `provisioning`, `active` or `failed`)."""
    with _client() as ivy:
        if follow:
            json_lines = as_json or not sys.stdout.isatty()
            display = display_for(stream=sys.stdout, console=Console(), json_lines=json_lines)
            _watch(ivy, chat_id, timeout, display)
            return
        body = _client_call(lambda: ivy.sandbox.status(chat_id))
    emit_status(body, as_json)


def stop(
    chat_id: Annotated[str, typer.Argument(metavar="CHAT_ID")], as_json: JsonFlag = False
) -> None:
    """Stop the chat's sandbox (the workspace is kept); prints `none`."""
    with _client() as ivy:
        body = _client_call(lambda: ivy.sandbox.stop(chat_id))
    emit_status(body, as_json)


def exec_command(
    chat_id: Annotated[str, typer.Argument(metavar="CHAT_ID")],
    command: Annotated[list[str], typer.Argument(metavar="-- CMD [ARG...]")],
    timeout: Annotated[float, typer.Option(help="Kill the command after SECONDS.")] = 60.0,
) -> None:
    """Run CMD in the chat's sandbox; prints its output and exits with its exit code."""
    stdin = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()
    with _client() as ivy:
        result = _client_call(
            lambda: ivy.sandbox.exec(chat_id, command, timeout_seconds=timeout, stdin=stdin)
        )
    sys.stdout.write(result["stdout"])
    sys.stderr.write(result["stderr"])
    if result.get("truncated"):
        typer.echo("ivy-sandbox: output truncated", err=True)
    if result.get("timedOut"):
        typer.echo(f"ivy-sandbox: timed out after {timeout:g} s", err=True)
    raise typer.Exit(int(result["exitCode"]))


def register(app: typer.Typer) -> None:
    app.command()(launch)
    app.command()(status)
    app.command()(stop)
    app.command(
        "exec", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
    )(exec_command)


def emit_status(body: dict[str, Any], as_json: bool) -> None:
    """The status value, or with --json the body exactly as the server sent it."""
    typer.echo(status_json(body) if as_json else str(body["status"]))

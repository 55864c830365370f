"""Client commands: talk to a server over HTTP (IVY_API_URL + IVY_API_KEY) through the SDK."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer

from ivy_sandbox.cli.common import JsonFlag, emit, fail

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


class ProgressLines:
    """Writes one stderr line per visible change of status, phase or ETA."""

    def __init__(self) -> None:
        self.last = ""

    def __call__(self, body: dict[str, Any]) -> None:
        parts = [str(body.get("status", "?"))]
        if "phase" in body:
            parts.append(str(body["phase"]))
        if "etaSeconds" in body:
            parts.append(f"~{body['etaSeconds']} s")
        line = " ".join(parts)
        if line != self.last:
            typer.echo(line, err=True)
            self.last = line


def launch(
    chat_id: Annotated[str, typer.Argument(metavar="CHAT_ID")],
    wait: Annotated[bool, typer.Option("--wait", help="Wait until the sandbox is active.")] = False,
    timeout: Annotated[float, typer.Option(help="With --wait: give up after SECONDS.")] = 300.0,
    as_json: JsonFlag = False,
) -> None:
    """Launch the chat's sandbox; prints its status (with --wait: `active`, or fails)."""
    with _client() as ivy:
        body = _client_call(lambda: ivy.sandbox.launch(chat_id))
        if wait and body.get("status") != "active":
            progress = ProgressLines()
            progress(body)
            body = _client_call(
                lambda: ivy.sandbox.wait_until_ready(chat_id, timeout=timeout, on_progress=progress)
            )
    emit(str(body["status"]), as_json, body)


def status(
    chat_id: Annotated[str, typer.Argument(metavar="CHAT_ID")], as_json: JsonFlag = False
) -> None:
    """Print the sandbox status (`none`, `provisioning`, `active` or `failed`)."""
    with _client() as ivy:
        body = _client_call(lambda: ivy.sandbox.status(chat_id))
    emit(str(body["status"]), as_json, body)


def stop(
    chat_id: Annotated[str, typer.Argument(metavar="CHAT_ID")], as_json: JsonFlag = False
) -> None:
    """Stop the chat's sandbox (the workspace is kept); prints `none`."""
    with _client() as ivy:
        body = _client_call(lambda: ivy.sandbox.stop(chat_id))
    emit(str(body["status"]), as_json, body)


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

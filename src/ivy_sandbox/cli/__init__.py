"""The ``ivy-sandbox`` command line.

Scriptable by contract: a command prints only its value on stdout (an id, a key, one line per
listed item) unless ``--json`` is given; errors are one line on stderr with a non-zero exit
(1 for a refused request, 2 for bad configuration or usage).
"""

from __future__ import annotations

import sys

import typer

from ivy_sandbox.cli import client, server
from ivy_sandbox.cli.admin import admin

app = typer.Typer(
    name="ivy-sandbox",
    help="Run and administer an ivy-sandbox server, and use one.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
server.register(app)
client.register(app)
app.add_typer(admin, name="admin", no_args_is_help=True)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)

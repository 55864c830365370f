"""Serve a baseline ASGI app on exactly the server stack `ivy-sandbox serve` uses.

``python bench/apps/run.py MODULE --port P`` runs ``ivy_sandbox.cli.server.serve`` itself —
settings, preflight, logging set-up and its ``uvicorn.run(...)`` call with its flags — with
``ivy_sandbox.api.app.create_app`` swapped for a function returning the baseline app. So the
baselines always run with whatever server, loop, HTTP parser, access-log and logging settings
`serve` has today, without copying them here. The benchmark checks that the baseline, not
our app, answers (the bare app's ``x-bench-app`` header, the FastAPI app's OpenAPI title).

``--plain-uvicorn`` instead calls ``uvicorn.run(app, host, port, log_level="warning",
access_log=False)``: the same app without the access log, to show what logging costs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("module", help="bare_asgi or fastapi_constant")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--plain-uvicorn", action="store_true")
    args = p.parse_args()
    app = importlib.import_module(args.module).app

    if args.plain_uvicorn:
        import uvicorn

        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
        return

    import ivy_sandbox.api.app
    from ivy_sandbox.cli import server

    def create_app(*_args: Any, **_kwargs: Any) -> Any:
        return app

    ivy_sandbox.api.app.create_app = create_app  # type: ignore[assignment]
    server.serve(host=args.host, port=args.port)


if __name__ == "__main__":
    main()

"""Baseline: FastAPI with one handler on the status route that returns a constant.

No dependencies, no database, no middleware: what the framework costs on its own. The
benchmark recognises it by its OpenAPI title, "FastAPI".
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

app = FastAPI()

BODY: dict[str, Any] = {
    "status": "active",
    "phase": "ready",
    "createdAt": "2026-11-29T10:02:02.571Z",
}


@app.get("/v1/sandbox/{chat_id}/status")
async def status(chat_id: str) -> dict[str, Any]:  # noqa: ARG001
    return BODY

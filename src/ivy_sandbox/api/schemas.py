"""Wire schemas that are not domain shapes: the problem body and the documented errors."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class Problem(BaseModel):
    """An error body (RFC 9457 problem details) with a stable ``code``."""

    type: str = Field(examples=["urn:ivy-sandbox:error:forbidden"])
    title: str = Field(examples=["Forbidden"])
    status: int = Field(examples=[403])
    detail: str
    code: str = Field(description="Stable machine-readable error code", examples=["forbidden"])


PROBLEM_REF = "#/components/schemas/Problem"


def _problem(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": description,
        "content": {"application/problem+json": {"schema": {"$ref": PROBLEM_REF}}},
    }
    if headers:
        response["headers"] = headers
    return response


PROBLEM_RESPONSES: dict[int, dict[str, Any]] = {
    401: _problem(
        "Authentication required",
        {"WWW-Authenticate": {"schema": {"type": "string"}, "description": "Bearer challenge"}},
    ),
    403: _problem("You do not own this chat, or your key's project scope excludes it"),
    429: _problem(
        "Rate limit exceeded",
        {
            "Retry-After": {"schema": {"type": "integer"}, "description": "Seconds to wait"},
            "RateLimit-Policy": {"schema": {"type": "string"}},
            "RateLimit": {"schema": {"type": "string"}},
        },
    ),
}

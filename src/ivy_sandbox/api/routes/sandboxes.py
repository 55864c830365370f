"""Sandbox routes. The status route is the seed page's contract, worded as the seed words it."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path
from fastapi.responses import JSONResponse
from starlette.convertors import Convertor, register_url_convertor

from ivy_sandbox.api.deps import CurrentPrincipal, ServicesDep
from ivy_sandbox.api.schemas import PROBLEM_RESPONSES
from ivy_sandbox.domain.sandbox import StatusBody
from ivy_sandbox.services import sandboxes


class AnyTextConvertor(Convertor[str]):
    """Matches any text, newlines and slashes included (Starlette's ``path`` stops at ``\n``)."""

    regex = r"[\s\S]*"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("anytext", AnyTextConvertor())

router = APIRouter(tags=["sandbox"])

ChatIdPath = Annotated[
    str, Path(alias="chatId", description="ID of the chat that owns the sandbox")
]

STATUS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": StatusBody, "description": "Current sandbox state"},
    401: PROBLEM_RESPONSES[401],
    403: PROBLEM_RESPONSES[403],
    429: PROBLEM_RESPONSES[429],
}


# `:anytext` lets any chatId through (encoded slashes, newlines, empty), so every input reaches
# the one authorization decision and gets the uniform 403 — never a router 404.
@router.get(
    "/sandbox/{chatId:anytext}/status",
    summary="Get sandbox status",
    description=(
        "Returns the current state of your chat's sandbox. `status` is `none` when the chat "
        "has no sandbox. While `provisioning`, `phase` and `etaSeconds` describe launch "
        "progress; poll about once per second or two."
    ),
    operation_id="getSandboxStatus",
    response_class=JSONResponse,
    responses=STATUS_RESPONSES,
)
async def get_sandbox_status(
    chat_id: ChatIdPath, principal: CurrentPrincipal, services: ServicesDep
) -> JSONResponse:
    body = await sandboxes.get_status(
        chat_id,
        principal,
        repository=services.repository,
        limiter=services.limiter,
        clock=services.clock,
    )
    return JSONResponse(body)

"""Sandbox routes. The status route is the seed page's contract, worded as the seed words it."""

from __future__ import annotations

import functools
from typing import Annotated, Any

from fastapi import APIRouter, Header, Path, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.convertors import Convertor, register_url_convertor

from ivy_sandbox.api.deps import CurrentPrincipal, ServicesDep, reauthenticate
from ivy_sandbox.api.schemas import (
    EXAMPLE_EVENT_STREAM,
    PROBLEM_RESPONSES,
    ExecBody,
    ExecResponse,
    SandboxDetail,
    status_response,
)
from ivy_sandbox.backends.base import ExecRequest
from ivy_sandbox.services import sandboxes, watch
from ivy_sandbox.services.watch import MAX_WAIT_SECONDS


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
    200: status_response("Current sandbox state", "provisioning", "active", "failed", "none")
    | {
        "headers": {
            "ETag": {
                "description": "Long-poll answers only: the state's token (quoted); send it "
                "back as `since` to wait for the next change.",
                "schema": {"type": "string"},
            },
            "Preference-Applied": {
                "description": "Long-poll answers only: the wait that was applied, e.g. "
                "`wait=60` (requests for more are capped at 60 s).",
                "schema": {"type": "string"},
            },
        }
    },
    401: PROBLEM_RESPONSES[401],
    403: PROBLEM_RESPONSES[403],
    429: PROBLEM_RESPONSES[429],
}


PREFER_DESCRIPTION = (
    "Long-poll: `wait=N` (N ≤ 60) holds the request until the status or phase differs from "
    "`since` (or from the state when the request arrived), or N seconds pass; the answer is "
    "then 200 with the current body. While it waits, the credential is checked again every "
    "15 s (`IVY_WATCH_KEEPALIVE_SECONDS`): if it was revoked or expired meanwhile, the wait "
    "ends with the ordinary 401 `unauthenticated` problem and `WWW-Authenticate`. Without "
    "`wait` the endpoint answers at once."
)
SINCE_DESCRIPTION = (
    "With `Prefer: wait=N`: the `ETag` (without quotes) of the last status you saw; the "
    "request returns as soon as the state differs from it."
)


def wait_preference(prefer: str | None) -> float | None:
    """``Prefer: wait=N`` (RFC 7240) → N, capped at 60; anything unusable → no wait."""
    if not prefer:
        return None
    for token in prefer.split(","):
        name, _, value = token.strip().partition("=")
        if name.strip().lower() == "wait" and value.strip().isdigit():
            return float(min(int(value.strip()), MAX_WAIT_SECONDS))
    return None


# `:anytext` lets any chatId through (encoded slashes, newlines, empty), so every input reaches
# the one authorization decision and gets the uniform 403 — never a router 404.
@router.get(
    "/sandbox/{chatId:anytext}/status",
    summary="Get sandbox status",
    description=(
        "Returns the current state of your chat's sandbox. `status` is `none` when the chat "
        "has no sandbox. While `provisioning`, `phase` and `etaSeconds` describe launch "
        "progress; poll about once per second or two. With `Prefer: wait=N` it long-polls "
        "(see the `Prefer` header); a long-poll whose credential is revoked or expires while "
        "it waits ends with 401, like any request made with that credential."
    ),
    operation_id="getSandboxStatus",
    response_class=JSONResponse,
    responses=STATUS_RESPONSES,
)
async def get_sandbox_status(
    chat_id: ChatIdPath,
    request: Request,
    principal: CurrentPrincipal,
    services: ServicesDep,
    prefer: Annotated[str | None, Header(description=PREFER_DESCRIPTION)] = None,
    # No constraints here: a bad value must never turn into a 422 on this endpoint.
    since: Annotated[str | None, Query(description=SINCE_DESCRIPTION)] = None,
) -> JSONResponse:
    wait = wait_preference(prefer)
    if wait is None:
        body = await sandboxes.get_status(
            chat_id,
            principal,
            repository=services.repository,
            limiter=services.limiter,
            clock=services.clock,
        )
        return JSONResponse(body)
    body, token = await watch.wait_for_change(
        services.watching,
        principal,
        chat_id,
        since=since,
        wait_seconds=wait,
        still_authenticated=functools.partial(reauthenticate, request),
        keepalive_seconds=services.settings.watch_keepalive_seconds,
    )
    return JSONResponse(
        body, headers={"ETag": f'"{token}"', "Preference-Applied": f"wait={wait:g}"}
    )


@router.get(
    "/sandbox/{chatId:anytext}/events",
    summary="Watch the sandbox status (Server-Sent Events)",
    description=(
        "A `text/event-stream`: the first event is the current status body, then one event "
        "per change of status, phase, error or estimate (each `event: status`, `data:` the "
        "same JSON as the status endpoint, `id:` its state token), keep-alive comments at "
        "least every 15 s (`IVY_WATCH_KEEPALIVE_SECONDS`). The stream ends after `active`, "
        "`failed` or `none`, or — when the credential, checked again at every keep-alive, was "
        'revoked or expired — with `event: error` and `data: {"code":"unauthenticated"}` '
        "(reconnecting with that credential gets the ordinary 401). Same authentication (the "
        "`__session` cookie works for browsers' EventSource), scoping and limits as the status "
        "endpoint."
    ),
    operation_id="watchSandboxStatus",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "A stream of status events",
            "content": {
                "text/event-stream": {"schema": {"type": "string"}, "example": EXAMPLE_EVENT_STREAM}
            },
        },
        401: PROBLEM_RESPONSES[401],
        403: PROBLEM_RESPONSES[403],
        429: PROBLEM_RESPONSES[429],
    },
)
async def watch_sandbox_status(
    chat_id: ChatIdPath, request: Request, principal: CurrentPrincipal, services: ServicesDep
) -> StreamingResponse:
    stream = await watch.status_stream(
        services.watching,
        principal,
        chat_id,
        still_authenticated=functools.partial(reauthenticate, request),
        keepalive_seconds=services.settings.watch_keepalive_seconds,
    )
    return StreamingResponse(
        stream, media_type="text/event-stream", headers={"X-Accel-Buffering": "no"}
    )


# The routes below share the `anytext` chatId; those with a suffix (/exec, /keepalive) are
# registered before the bare /sandbox/{chatId} ones so the suffix is never read as an id.
SANDBOX_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: PROBLEM_RESPONSES[401],
    403: PROBLEM_RESPONSES[403],
    429: PROBLEM_RESPONSES[429],
}


@router.post(
    "/sandbox/{chatId:anytext}/exec",
    summary="Run a command in the sandbox",
    description=(
        "Runs `command` inside the chat's active sandbox, with `/workspace` as the default "
        "working directory, and returns its exit code and output. Output beyond the server's "
        "limit is cut (`truncated`); after `timeoutSeconds` the command and every process it "
        "started are killed (`timedOut`, exit code 137). 409 unless the sandbox is active."
    ),
    operation_id="execInSandbox",
    response_model=ExecResponse,
    responses={
        **SANDBOX_RESPONSES,
        409: PROBLEM_RESPONSES[409],
        413: PROBLEM_RESPONSES[413],
        422: PROBLEM_RESPONSES[422],
    },
)
async def exec_in_sandbox(
    chat_id: ChatIdPath, body: ExecBody, principal: CurrentPrincipal, services: ServicesDep
) -> ExecResponse:
    settings = services.settings
    request = ExecRequest(
        command=body.command,
        timeout_seconds=min(body.timeoutSeconds, settings.exec_max_timeout),
        cwd=body.cwd,
        env=body.env,
        stdin=body.stdin.encode(),
        output_limit_bytes=settings.exec_output_limit,
    )
    result = await sandboxes.execute(services.sandbox_context, principal, chat_id, request)
    return ExecResponse(
        exitCode=result.exit_code,
        stdout=result.stdout.decode(errors="replace"),
        stderr=result.stderr.decode(errors="replace"),
        durationMs=result.duration_ms,
        truncated=result.truncated,
        timedOut=result.timed_out,
    )


@router.post(
    "/sandbox/{chatId:anytext}/keepalive",
    summary="Keep the sandbox from being reaped as idle",
    description="Counts as activity for idle reaping (status polls do not). 409 unless active.",
    operation_id="keepSandboxAlive",
    response_class=JSONResponse,
    responses={
        200: status_response("Current sandbox state", "active"),
        **SANDBOX_RESPONSES,
        409: PROBLEM_RESPONSES[409],
    },
)
async def keep_sandbox_alive(
    chat_id: ChatIdPath, principal: CurrentPrincipal, services: ServicesDep
) -> JSONResponse:
    body = await sandboxes.keep_alive(services.sandbox_context, principal, chat_id)
    return JSONResponse(body)


@router.post(
    "/sandbox/{chatId:anytext}",
    summary="Launch the chat's sandbox",
    description=(
        "Starts a sandbox for the chat and returns at once with its status (202); watch it "
        "with the status endpoint. Idempotent: while a sandbox is provisioning or active the "
        "current one is returned; after `failed` a new one replaces it."
    ),
    operation_id="launchSandbox",
    status_code=202,
    response_class=JSONResponse,
    responses={
        202: status_response("Current sandbox state", "provisioning", "active"),
        **SANDBOX_RESPONSES,
    },
)
async def launch_sandbox(
    chat_id: ChatIdPath, principal: CurrentPrincipal, services: ServicesDep
) -> JSONResponse:
    body = await sandboxes.launch(services.sandbox_context, principal, chat_id)
    return JSONResponse(body, status_code=202)


@router.delete(
    "/sandbox/{chatId:anytext}",
    summary="Stop the chat's sandbox",
    description="Stops the sandbox from any state; the chat's workspace is kept.",
    operation_id="stopSandbox",
    response_class=JSONResponse,
    responses={
        200: status_response("The chat has no sandbox any more", "none"),
        **SANDBOX_RESPONSES,
    },
)
async def stop_sandbox(
    chat_id: ChatIdPath, principal: CurrentPrincipal, services: ServicesDep
) -> JSONResponse:
    body = await sandboxes.stop(services.sandbox_context, principal, chat_id)
    return JSONResponse(body)


@router.get(
    "/sandbox/{chatId:anytext}",
    summary="Get the sandbox's full record",
    description=(
        "The status fields plus `errorCode`, the phase timeline, `readyAt`, `lastActivityAt` "
        "and, while a launch waits for capacity, its place in the queue."
    ),
    operation_id="getSandbox",
    response_model=SandboxDetail,
    response_model_exclude_none=True,
    responses=SANDBOX_RESPONSES,
)
async def get_sandbox(
    chat_id: ChatIdPath, principal: CurrentPrincipal, services: ServicesDep
) -> JSONResponse:
    body = await sandboxes.detail(services.sandbox_context, principal, chat_id)
    return JSONResponse(body)

"""Sandbox use cases on the API side: status, launch, stop, detail, exec, keep-alive.

The provisioning itself happens in the worker (:mod:`ivy_sandbox.workers.provisioner`); these
functions only read and write the database (the source of truth) and, for stop and exec,
call the backend directly — any process on the control plane can reach a sandbox through
the state the backend stored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ivy_sandbox.auth.principal import Principal
from ivy_sandbox.backends.base import BackendError, ExecRequest, ExecResult, SandboxBackend
from ivy_sandbox.domain.eta import seconds_until_ready
from ivy_sandbox.domain.ids import is_acceptable_id, new_id
from ivy_sandbox.domain.sandbox import (
    Phase,
    SandboxStatus,
    StatusBody,
    rfc3339,
    status_body,
)
from ivy_sandbox.errors import Conflict, PermissionDenied
from ivy_sandbox.ratelimit import RateLimiter
from ivy_sandbox.services.clock import Clock
from ivy_sandbox.storage.repository import ChatAccess, Repository
from ivy_sandbox.storage.sandboxes import SandboxRecord, SandboxRepository, next_timeline

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SandboxContext:
    """The collaborators of the sandbox use cases, wired once by the bootstrap."""

    repository: Repository
    sandboxes: SandboxRepository
    backend: SandboxBackend
    limiter: RateLimiter
    clock: Clock
    kick_worker: Callable[[], None]


async def authorize_chat(repository: Repository, principal: Principal, chat_id: str) -> ChatAccess:
    """The single authorization decision for a chat, with one failure for every cause.

    A malformed id cannot name a chat, so it is denied without a query — with the same
    exception, body and code path as a missing, foreign or out-of-scope chat.
    """
    access = None
    if is_acceptable_id(chat_id):
        access = await repository.chat_access(chat_id, principal.user_id, principal.project_id)
    if access is None:
        raise PermissionDenied(f"chat access denied for {principal.kind} {principal.credential_id}")
    return access


async def _checked_chat(ctx: SandboxContext, principal: Principal, chat_id: str) -> ChatAccess:
    await ctx.limiter.check_chat(principal.user_id, chat_id)
    return await authorize_chat(ctx.repository, principal, chat_id)


async def get_status(
    chat_id: str,
    principal: Principal,
    *,
    repository: Repository,
    limiter: RateLimiter,
    clock: Clock,
) -> StatusBody:
    await limiter.check_chat(principal.user_id, chat_id)
    access = await authorize_chat(repository, principal, chat_id)
    return status_body(access.sandbox, clock.now())


async def launch(ctx: SandboxContext, principal: Principal, chat_id: str) -> StatusBody:
    """Start a sandbox for the chat, or return the one already provisioning or active."""
    await _checked_chat(ctx, principal, chat_id)
    await ctx.limiter.check_launch(principal.user_id)
    now = ctx.clock.now()
    stats = await ctx.sandboxes.phase_stats(ctx.backend.name)
    record = SandboxRecord(
        id=new_id("sbx"),
        chat_id=chat_id,
        status=SandboxStatus.PROVISIONING,
        phase=Phase.COMPUTE,
        error_code=None,
        error_message=None,
        eta_seconds=seconds_until_ready(ctx.backend.name, Phase.COMPUTE, stats),
        created_at=now,
        phase_started_at=now,
        ready_at=None,
        last_activity_at=None,
        updated_at=now,
        backend=ctx.backend.name,
        backend_state={},
        lease_owner=None,
        lease_expires_at=None,
        admitted_at=None,
        timeline=next_timeline([], now, Phase.COMPUTE),
    )
    current, created = await ctx.sandboxes.launch(record)
    if created:
        log.info("launch %s for chat %s", current.id, chat_id)
        ctx.kick_worker()
    return status_body(current.snapshot(), ctx.clock.now())


async def stop(ctx: SandboxContext, principal: Principal, chat_id: str) -> StatusBody:
    """Stop the chat's sandbox from any state; the workspace is kept."""
    await _checked_chat(ctx, principal, chat_id)
    removed = await ctx.sandboxes.remove(chat_id)
    if removed is not None:
        log.info("stop %s (%s) for chat %s", removed.id, removed.status, chat_id)
        # A worker still provisioning it notices at its next fenced write and cleans up what
        # it started; the orphan sweep catches anything left by a crash in between.
        if removed.backend_state:
            await ctx.backend.stop(removed.backend_state)
    return {"status": "none"}


async def detail(ctx: SandboxContext, principal: Principal, chat_id: str) -> dict[str, Any]:
    """The full record: the status fields plus errorCode, timeline, times and queue state."""
    await _checked_chat(ctx, principal, chat_id)
    record = await ctx.sandboxes.by_chat(chat_id)
    if record is None:
        return {"status": "none"}
    body: dict[str, Any] = dict(status_body(record.snapshot(), ctx.clock.now()))
    body["sandboxId"] = record.id
    body["backend"] = record.backend
    if record.error_code:
        body["errorCode"] = record.error_code
    body["phases"] = record.timeline
    if record.ready_at is not None:
        body["readyAt"] = rfc3339(record.ready_at)
    if record.last_activity_at is not None:
        body["lastActivityAt"] = rfc3339(record.last_activity_at)
    position = await ctx.sandboxes.queue_position(record)
    if position is not None:
        body["waiting"] = {"reason": "capacity", "queuePosition": position}
    return body


async def _active(ctx: SandboxContext, principal: Principal, chat_id: str) -> SandboxRecord:
    await _checked_chat(ctx, principal, chat_id)
    record = await ctx.sandboxes.by_chat(chat_id)
    if record is None or record.status is not SandboxStatus.ACTIVE:
        status = "none" if record is None else record.status.value
        raise Conflict(
            f"sandbox not active ({status})",
            detail=f"The chat's sandbox is not active (status: {status}); launch it first.",
        )
    return record


async def execute(
    ctx: SandboxContext, principal: Principal, chat_id: str, request: ExecRequest
) -> ExecResult:
    """Run a command in the chat's active sandbox; counts as activity for idle reaping."""
    record = await _active(ctx, principal, chat_id)
    await ctx.sandboxes.touch_activity(record.id, ctx.clock.now())
    try:
        result = await ctx.backend.exec(record.backend_state, request)
    except BackendError as exc:
        raise Conflict(
            f"exec failed: {exc}", detail=f"The sandbox cannot run commands: {exc.message}"
        ) from None
    await ctx.sandboxes.touch_activity(record.id, ctx.clock.now())
    return result


async def keep_alive(ctx: SandboxContext, principal: Principal, chat_id: str) -> StatusBody:
    """Record activity so an idle sandbox is not reaped; returns the status."""
    record = await _active(ctx, principal, chat_id)
    await ctx.sandboxes.touch_activity(record.id, ctx.clock.now())
    return status_body(record.snapshot(), ctx.clock.now())

"""Sandbox use cases. For now: reading a chat's sandbox status (the seed endpoint)."""

from __future__ import annotations

from ivy_sandbox.auth.principal import Principal
from ivy_sandbox.domain.ids import is_acceptable_id
from ivy_sandbox.domain.sandbox import StatusBody, status_body
from ivy_sandbox.errors import PermissionDenied
from ivy_sandbox.ratelimit import RateLimiter
from ivy_sandbox.services.clock import Clock
from ivy_sandbox.storage.repository import ChatAccess, Repository


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


async def get_status(
    chat_id: str,
    principal: Principal,
    *,
    repository: Repository,
    limiter: RateLimiter,
    clock: Clock,
) -> StatusBody:
    # Malformed ids share one counter, so junk cannot grow the limiter's key space.
    await limiter.check_chat(principal.user_id, chat_id if is_acceptable_id(chat_id) else "~")
    access = await authorize_chat(repository, principal, chat_id)
    return status_body(access.sandbox, clock.now())

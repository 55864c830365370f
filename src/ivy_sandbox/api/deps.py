"""Typed dependencies shared by the routes: the wired services and the calling principal."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from ivy_sandbox.auth.credentials import extract_credential
from ivy_sandbox.auth.principal import Principal
from ivy_sandbox.bootstrap import Services
from ivy_sandbox.errors import AuthenticationFailed


async def get_services(request: Request) -> Services:
    # async: FastAPI runs a plain `def` dependency in its threadpool, on every request.
    services: Services = request.app.state.services
    return services


def client_ip(request: Request) -> str:
    # uvicorn rewrites request.client from X-Forwarded-For only for trusted proxies
    # (FORWARDED_ALLOW_IPS), so this cannot be spoofed by a direct client.
    return request.client.host if request.client else "unknown"


async def authenticate_caller(
    services: Services,
    authorization: str | None,
    api_key: str | None,
    cookie: str | None,
    ip: str,
) -> Principal:
    """Authenticate a caller and charge its per-user rate limit.

    A failed authentication is counted against the client's IP; once that IP is over
    ``IVY_AUTH_FAILURE_LIMIT``, its failures are answered 429 instead of 401 (valid
    credentials from the same address keep working).
    """
    try:
        credential = extract_credential(authorization, api_key, cookie)
        principal = await services.authenticator.authenticate(credential)
    except AuthenticationFailed:
        await services.limiter.record_auth_failure(ip)
        raise
    await services.limiter.check_user(principal.rate_limit_key)
    return principal


async def current_principal(request: Request) -> Principal:
    headers = request.headers
    return await authenticate_caller(
        request.app.state.services,
        headers.get("authorization"),
        headers.get("x-ivy-api-key"),
        headers.get("cookie"),
        client_ip(request),
    )


async def reauthenticate(request: Request) -> Principal:
    """Check the request's credential again (long-lived streams), without charging limits."""
    headers = request.headers
    credential = extract_credential(
        headers.get("authorization"), headers.get("x-ivy-api-key"), headers.get("cookie")
    )
    services: Services = request.app.state.services
    return await services.authenticator.authenticate(credential)


ServicesDep = Annotated[Services, Depends(get_services)]
CurrentPrincipal = Annotated[Principal, Depends(current_principal)]

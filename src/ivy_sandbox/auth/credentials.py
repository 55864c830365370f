"""Which credential a request carries (DESIGN §3), decided from its headers alone.

Order: ``X-Ivy-Api-Key`` or ``Authorization: Bearer ivy_…`` → API key; ``Authorization:
Bearer <JWT>`` → Clerk session token; the ``__session`` cookie (or ``__session_<suffix>``) →
Clerk session token. A present ``Authorization`` or ``X-Ivy-Api-Key`` header wins over the
cookie, even when the header is invalid (a broken header is a 401, not a silent fallback).
Sending an API key in both headers with different values is ambiguous and rejected.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import StrEnum
from http.cookies import CookieError, SimpleCookie

from ivy_sandbox.auth.api_keys import looks_like_api_key
from ivy_sandbox.errors import AuthenticationFailed

SESSION_COOKIE = "__session"
MAX_CREDENTIAL_LENGTH = 8192


class CredentialType(StrEnum):
    API_KEY = "api_key"
    SESSION_TOKEN = "session_token"  # noqa: S105 - a label, not a secret


@dataclass(frozen=True, slots=True)
class Credential:
    type: CredentialType
    value: str


def _bearer(authorization: str) -> str:
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        raise AuthenticationFailed("authorization header: scheme is not Bearer")
    token = token.strip()
    if not token:
        raise AuthenticationFailed("authorization header: empty bearer token")
    return token


def session_cookie(cookie_header: str) -> str | None:
    """The Clerk session cookie: ``__session`` first, else the first ``__session_<suffix>``."""
    if SESSION_COOKIE not in cookie_header:
        return None
    return _parse_session_cookie(cookie_header)


# SimpleCookie costs 10-20 µs per header, a sixth of a whole status poll; a browser sends the
# same header on every poll. The memo holds session tokens only, which expire within about a
# minute (Clerk's short-lived session tokens), so a stale entry is worthless to anyone.
@functools.lru_cache(maxsize=256)  # headers are ≤ 16 KiB: at most 4 MiB
def _parse_session_cookie(cookie_header: str) -> str | None:
    jar = SimpleCookie()
    try:
        jar.load(cookie_header)
    except CookieError:
        return None
    if SESSION_COOKIE in jar:
        return jar[SESSION_COOKIE].value or None
    for name, morsel in jar.items():
        if name.startswith(SESSION_COOKIE + "_") and morsel.value:
            return morsel.value
    return None


def _checked(credential: Credential) -> Credential:
    if len(credential.value) > MAX_CREDENTIAL_LENGTH:
        raise AuthenticationFailed("credential longer than allowed")
    return credential


def extract_credential(
    authorization: str | None, api_key_header: str | None, cookie_header: str | None
) -> Credential:
    """Pick the credential to verify, or raise AuthenticationFailed (never anything else)."""
    if api_key_header is not None:
        key = api_key_header.strip()
        if authorization is not None and _bearer(authorization) != key:
            raise AuthenticationFailed("two different credentials in one request")
        return _checked(Credential(CredentialType.API_KEY, key))
    if authorization is not None:
        token = _bearer(authorization)
        kind = CredentialType.API_KEY if looks_like_api_key(token) else CredentialType.SESSION_TOKEN
        return _checked(Credential(kind, token))
    if cookie_header:
        cookie = session_cookie(cookie_header)
        if cookie is not None:
            return _checked(Credential(CredentialType.SESSION_TOKEN, cookie))
    raise AuthenticationFailed("no credentials", credential_sent=False)

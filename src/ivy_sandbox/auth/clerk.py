"""Offline verification of Clerk session tokens (JWTs), as DESIGN §3 describes.

What is checked, in order (each failure raises ``AuthenticationFailed`` with its own
``log_message`` starting ``"jwt: "``; no message ever contains the token):

1. the verifier is configured (a PEM public key or a JWKS URL);
2. the token is short, ASCII, and not an opaque Clerk machine token (``mt_``/``oat_``/``ak_``);
3. header: ``alg`` is exactly ``RS256`` (``none``, ``HS256`` — including the classic confusion
   of an HMAC keyed with the PEM text — ``ES256``, ``PS256`` … are refused before any key is
   touched, and the key we pass is an RSA key object bound to RS256, never bytes); ``typ`` is
   exactly ``JWT``; no ``crit``/``b64``; ``cat`` (see below) marks a session token;
4. key: the configured PEM (which wins when both are set, like Clerk's ``jwtKey``), or the key
   with the token's ``kid`` from the configured JWKS URL. The JWKS is fetched with httpx
   (async), cached by ``kid``, refetched when a token names an unknown ``kid`` — at most once
   per :data:`JWKS_MIN_REFETCH_SECONDS` so unknown-``kid`` floods cannot hammer the endpoint —
   and refreshed once it is :data:`JWKS_MAX_AGE_SECONDS` old. ``jku``, ``x5u``, ``jwk`` and
   ``x5c`` in the token header are ignored: no URL or key ever comes from the token;
5. RS256 signature;
6. claims: ``exp``, ``iat``, ``sub``, ``sid`` present and well typed; ``exp``/``nbf``/``iat``
   against the injected clock with ``leeway_seconds`` (5 s) of skew; ``sub`` starts with
   ``user_``; ``iss`` equals the configured issuer when one is set; ``azp`` is in the allow-list
   when one is set (a token without ``azp`` is then refused); ``sts`` is not ``pending``.

Token categories — what Clerk does and what we decided
------------------------------------------------------
Searched ``clerk/javascript`` (``packages/backend/src/tokens``) and Clerk's docs:

* ``tokenTypes.ts``: the backend SDK knows four token types — ``session_token``, ``api_key``,
  ``machine_token`` (M2M) and ``oauth_token``. ``authenticateRequest`` accepts session tokens
  only unless ``acceptsToken`` says otherwise.
* ``machine.ts``: opaque machine tokens are told apart by prefix — ``mt_`` (M2M), ``oat_``
  (OAuth access token), ``ak_`` (API key). JWT-format machine tokens are told apart by claims
  and header: an M2M JWT has ``sub`` starting with ``mch_`` (``M2M_SUBJECT_PREFIX``); an OAuth
  JWT access token has header ``typ`` ``at+jwt`` or ``application/at+jwt`` (RFC 9068,
  ``OAUTH_ACCESS_TOKEN_TYPES``). Session tokens carry ``typ: "JWT"``.
* ``jwtCategories.ts``: newer Clerk instances stamp a ``cat`` header on every JWT they sign with
  the instance key: ``cl_B7d4PD111AAA`` session token (handshake tokens too),
  ``cl_B7d4PD222AAA`` JWT-template token, ``cl_B7d4PD333AAA`` M2M token; ``cl_I7d4PD111III``
  is stamped on every class by instances that opted out, so it carries no information. An
  absent ``cat`` is accepted (tokens minted before the rollout). Real session-token headers
  seen in the wild match: ``{"alg":"RS256","cat":"cl_B7d4PD111AAA","kid":"ins_…","typ":"JWT"}``.
  JWT templates matter most: they are signed with the *same* key, can carry ``sub: user_…``
  and, if the template says so, ``sid`` — so without ``cat`` they would pass every other check.

Decided: refuse opaque ``mt_``/``oat_``/``ak_`` tokens up front; refuse ``typ`` ``at+jwt`` /
``application/at+jwt`` (OAuth access token), any other ``typ`` but ``JWT``, and a missing
``typ``; refuse any ``cat`` other than the session category or the opt-out marker (JWT
templates, M2M, and unknown future categories — fail closed); refuse ``sub`` with ``mch_``
(M2M JWT) and any other ``sub`` that is not ``user_…``; require ``sid`` (M2M, OAuth and most
template tokens have none). Legacy tokens without ``cat`` remain accepted, as Clerk does.

Performance
-----------
A full decode costs ~70 µs (NOTES.md), so verified tokens are cached by
``sha256(token)`` → :class:`SessionClaims` in a bounded FIFO dict. A cached entry is served
only while ``clock() < exp`` (and not before ``max(iat, nbf) - leeway``); after ``exp`` the
token goes through full verification again, which accepts it inside the leeway and refuses it
from ``exp + leeway`` on. Keys are parsed once into ``PyJWK`` objects. :attr:`ClerkVerifier.stats`
counts decodes, cache hits and JWKS fetches.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import httpx
import jwt
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey
from cryptography.hazmat.primitives.serialization import load_pem_public_key
from jwt.algorithms import RSAAlgorithm

from ivy_sandbox.errors import AuthenticationFailed, ConfigurationError

__all__ = [
    "JWKS_MAX_AGE_SECONDS",
    "JWKS_MIN_REFETCH_SECONDS",
    "ClerkVerifier",
    "SessionClaims",
    "VerifierStats",
]

logger = logging.getLogger(__name__)

JWKS_MIN_REFETCH_SECONDS: Final = 30.0
JWKS_MAX_AGE_SECONDS: Final = 3600.0
JWKS_TIMEOUT_SECONDS: Final = 5.0
MAX_TOKEN_LENGTH: Final = 8192  # Clerk session tokens are ~1 kB; a cookie cannot exceed 4 kB

SESSION_CATEGORY: Final = "cl_B7d4PD111AAA"
IGNORED_CATEGORY: Final = "cl_I7d4PD111III"
_ACCEPTED_CATEGORIES: Final = frozenset({SESSION_CATEGORY, IGNORED_CATEGORY})
_OAUTH_ACCESS_TOKEN_TYPES: Final = frozenset({"at+jwt", "application/at+jwt"})
_OPAQUE_MACHINE_PREFIXES: Final = ("mt_", "oat_", "ak_")
_UNSUPPORTED_HEADERS: Final = ("crit", "b64")
_ALGORITHM: Final = "RS256"
_ALGORITHMS: Final = [_ALGORITHM]

_JWS = jwt.PyJWS(algorithms=_ALGORITHMS)


@dataclass(frozen=True, slots=True)
class SessionClaims:
    """The claims of a verified Clerk session token that the service uses."""

    user_id: str  # sub, always "user_…"
    session_id: str  # sid
    expires_at: float  # exp
    authorized_party: str | None  # azp


@dataclass(slots=True)
class VerifierStats:
    """Counters for tests and metrics."""

    decodes: int = 0  # tokens that reached signature verification
    cache_hits: int = 0  # tokens answered from the verified-token cache
    jwks_fetches: int = 0  # JWKS requests attempted


@dataclass(frozen=True, slots=True)
class _CacheEntry:
    claims: SessionClaims
    valid_from: float  # max(iat, nbf) - leeway
    valid_until: float  # exp (strict: after it, full verification decides)


def _reject(reason: str) -> AuthenticationFailed:
    return AuthenticationFailed(log_message=f"jwt: {reason}")


def _load_pem(pem: str) -> jwt.PyJWK:
    """Parse a ``CLERK_JWT_KEY``-style PEM once (headers optional, ``\\n`` escapes allowed)."""
    text = pem.strip().replace("\\n", "\n")
    if "-----BEGIN" not in text:
        body = "".join(text.split())
        text = f"-----BEGIN PUBLIC KEY-----\n{body}\n-----END PUBLIC KEY-----\n"
    try:
        public_key = load_pem_public_key(text.encode("ascii"))
    except (ValueError, TypeError, UnicodeEncodeError) as exc:
        raise ConfigurationError("IVY_CLERK_JWT_KEY: not a valid PEM public key") from exc
    if not isinstance(public_key, RSAPublicKey):
        raise ConfigurationError(
            "IVY_CLERK_JWT_KEY: not an RSA public key (Clerk signs with RS256)"
        )
    return jwt.PyJWK(RSAAlgorithm.to_jwk(public_key, as_dict=True), algorithm=_ALGORITHM)


def _parse_header(token: str) -> dict[str, Any]:
    """Decode the JOSE header only (the full, strict parse happens in PyJWT afterwards)."""
    segment, _, rest = token.partition(".")
    if not segment or rest.count(".") != 1:
        raise _reject("malformed token")
    try:
        header = json.loads(base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4)))
    except (binascii.Error, ValueError, RecursionError) as exc:
        raise _reject("malformed header") from exc
    if not isinstance(header, dict):
        raise _reject("malformed header")
    return header


def _check_header(header: dict[str, Any]) -> None:
    if header.get("alg") != _ALGORITHM:
        raise _reject("algorithm not RS256")
    typ = header.get("typ")
    if typ is None:
        raise _reject("typ header missing")
    if typ != "JWT":
        if isinstance(typ, str) and typ.lower() in _OAUTH_ACCESS_TOKEN_TYPES:
            raise _reject("oauth access token (typ at+jwt)")
        raise _reject("typ header not JWT")
    for name in _UNSUPPORTED_HEADERS:
        if name in header:
            raise _reject(f"unsupported header parameter {name}")
    if "cat" in header and header["cat"] not in _ACCEPTED_CATEGORIES:
        raise _reject("non-session token category")


def _number_claim(payload: dict[str, Any], name: str) -> float:
    value = payload.get(name)
    if value is None:
        raise _reject(f"missing claim {name}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _reject(f"claim {name} not a number")
    result = float(value)
    if not math.isfinite(result):
        raise _reject(f"claim {name} not a number")
    return result


def _string_claim(payload: dict[str, Any], name: str) -> str:
    value = payload.get(name)
    if value is None:
        raise _reject(f"missing claim {name}")
    if not isinstance(value, str) or not value:
        raise _reject(f"claim {name} not a string")
    return value


class ClerkVerifier:
    """Verifies Clerk session JWTs offline; one instance per process, shared by all requests."""

    def __init__(
        self,
        *,
        pem: str | None = None,
        jwks_url: str | None = None,
        issuer: str | None = None,
        authorized_parties: frozenset[str] = frozenset(),
        clock: Callable[[], float] = time.time,
        leeway_seconds: float = 5.0,
        http_client: httpx.AsyncClient | None = None,
        cache_size: int = 10_000,
    ) -> None:
        self._pem_key: jwt.PyJWK | None = _load_pem(pem) if pem else None
        self._jwks_url = jwks_url or None
        self._issuer = issuer or None
        self._authorized_parties = frozenset(authorized_parties)
        self._clock = clock
        self._leeway = float(leeway_seconds)
        self._http_client = http_client
        self._owns_http_client = http_client is None
        self._cache_size = max(0, cache_size)
        self._cache: dict[bytes, _CacheEntry] = {}
        self._jwks: dict[str, jwt.PyJWK] = {}
        self._jwks_fetched_at: float | None = None  # last attempt, successful or not
        self._jwks_loaded_at: float | None = None  # last success
        self._jwks_lock = asyncio.Lock()
        self.stats = VerifierStats()

    @property
    def configured(self) -> bool:
        return self._pem_key is not None or self._jwks_url is not None

    async def aclose(self) -> None:
        if self._owns_http_client and self._http_client is not None:
            await self._http_client.aclose()
            self._http_client = None

    async def verify(self, token: str) -> SessionClaims:
        if not self.configured:
            raise _reject("verifier not configured")
        if len(token) > MAX_TOKEN_LENGTH:
            raise _reject("token too long")
        if not token.isascii():
            raise _reject("token not ascii")

        cache_key = hashlib.sha256(token.encode("ascii")).digest()
        entry = self._cache.get(cache_key)
        if entry is not None:
            now = self._clock()
            if entry.valid_from <= now < entry.valid_until:
                self.stats.cache_hits += 1
                return entry.claims
            del self._cache[cache_key]  # expired (or clock moved back): verify from scratch

        return await self._verify_uncached(token, cache_key)

    async def _verify_uncached(self, token: str, cache_key: bytes) -> SessionClaims:
        if token.startswith(_OPAQUE_MACHINE_PREFIXES):
            raise _reject("opaque clerk machine token")
        header = _parse_header(token)
        _check_header(header)
        key = await self._key_for(header)

        self.stats.decodes += 1
        try:
            decoded = _JWS.decode_complete(token, key, algorithms=_ALGORITHMS)
        except jwt.InvalidSignatureError as exc:
            raise _reject("signature invalid") from exc
        except jwt.PyJWTError as exc:
            raise _reject("malformed token") from exc
        try:
            payload = json.loads(decoded["payload"])
        except (ValueError, RecursionError) as exc:
            raise _reject("payload not json") from exc
        if not isinstance(payload, dict):
            raise _reject("payload not an object")

        claims, valid_from = self._check_claims(payload)
        now = self._clock()
        if self._cache_size and valid_from <= now < claims.expires_at:
            if len(self._cache) >= self._cache_size:
                del self._cache[next(iter(self._cache))]  # oldest first ≈ soonest to expire
            self._cache[cache_key] = _CacheEntry(claims, valid_from, claims.expires_at)
        return claims

    def _check_claims(self, payload: dict[str, Any]) -> tuple[SessionClaims, float]:
        exp = _number_claim(payload, "exp")
        iat = _number_claim(payload, "iat")
        sub = _string_claim(payload, "sub")
        sid = _string_claim(payload, "sid")
        nbf = _number_claim(payload, "nbf") if "nbf" in payload else None

        now = self._clock()
        leeway = self._leeway
        if now >= exp + leeway:
            raise _reject("token expired")
        if nbf is not None and nbf > now + leeway:
            raise _reject("token not yet valid (nbf)")
        if iat > now + leeway:
            raise _reject("token issued in the future (iat)")

        if not sub.startswith("user_"):
            if sub.startswith("mch_"):
                raise _reject("machine token subject (mch_)")
            raise _reject("subject is not a user")

        if self._issuer is not None:
            iss = payload.get("iss")
            if iss is None:
                raise _reject("missing claim iss")
            if iss != self._issuer:
                raise _reject("issuer mismatch")

        azp = payload.get("azp")
        if azp is not None and not isinstance(azp, str):
            raise _reject("claim azp not a string")
        if self._authorized_parties:
            if azp is None:
                raise _reject("missing claim azp")
            if azp not in self._authorized_parties:
                raise _reject("azp not allowed")

        if payload.get("sts") == "pending":
            raise _reject("session pending")

        valid_from = max(iat, nbf if nbf is not None else iat) - leeway
        claims = SessionClaims(user_id=sub, session_id=sid, expires_at=exp, authorized_party=azp)
        return claims, valid_from

    # --- keys ---------------------------------------------------------------------------

    async def _key_for(self, header: dict[str, Any]) -> jwt.PyJWK:
        if self._pem_key is not None:
            return self._pem_key
        kid = header.get("kid")
        if not isinstance(kid, str) or not kid:
            raise _reject("kid missing")
        key = self._jwks.get(kid)
        now = self._clock()
        stale = self._jwks_loaded_at is None or now - self._jwks_loaded_at >= JWKS_MAX_AGE_SECONDS
        if (key is None or stale) and self._may_fetch(now):
            async with self._jwks_lock:
                # Another request may have fetched while we waited for the lock.
                key = self._jwks.get(kid)
                now = self._clock()
                stale = (
                    self._jwks_loaded_at is None
                    or now - self._jwks_loaded_at >= JWKS_MAX_AGE_SECONDS
                )
                if (key is None or stale) and self._may_fetch(now):
                    await self._fetch_jwks(now)
                    key = self._jwks.get(kid)
        if key is None:
            if self._jwks_loaded_at is None:
                raise _reject("jwks unavailable")
            raise _reject("unknown kid")
        return key

    def _may_fetch(self, now: float) -> bool:
        last = self._jwks_fetched_at
        return last is None or now - last >= JWKS_MIN_REFETCH_SECONDS or now < last

    async def _fetch_jwks(self, now: float) -> None:
        if self._jwks_url is None:
            return
        self._jwks_fetched_at = now
        self.stats.jwks_fetches += 1
        if self._http_client is None:
            self._http_client = httpx.AsyncClient(
                timeout=JWKS_TIMEOUT_SECONDS, follow_redirects=False
            )
        try:
            response = await self._http_client.get(self._jwks_url, timeout=JWKS_TIMEOUT_SECONDS)
            response.raise_for_status()
            document = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            logger.warning("clerk jwks fetch failed: %s", type(exc).__name__)
            return
        keys = self._parse_jwks(document)
        if not keys:
            logger.warning("clerk jwks fetch returned no usable RS256 keys")
            return
        self._jwks = keys
        self._jwks_loaded_at = now

    @staticmethod
    def _parse_jwks(document: object) -> dict[str, jwt.PyJWK]:
        keys: dict[str, jwt.PyJWK] = {}
        if not isinstance(document, dict):
            return keys
        entries = document.get("keys")
        if not isinstance(entries, list):
            return keys
        for entry in entries:
            if not isinstance(entry, dict):
                continue
            kid = entry.get("kid")
            if (
                not isinstance(kid, str)
                or not kid
                or entry.get("kty") != "RSA"
                or entry.get("use", "sig") != "sig"
                or entry.get("alg", _ALGORITHM) != _ALGORITHM
            ):
                continue
            try:
                keys[kid] = jwt.PyJWK(entry, algorithm=_ALGORITHM)
            except (jwt.PyJWTError, ValueError, TypeError, KeyError):
                continue
        return keys

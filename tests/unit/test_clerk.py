"""Offline verification of Clerk session JWTs (ivy_sandbox.auth.clerk)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jwt.algorithms import RSAAlgorithm

from ivy_sandbox.auth.clerk import (
    JWKS_MAX_AGE_SECONDS,
    JWKS_MIN_REFETCH_SECONDS,
    ClerkVerifier,
    SessionClaims,
)
from ivy_sandbox.errors import AuthenticationFailed, ConfigurationError

NOW = 1_750_000_000.0
ISSUER = "https://clerk.example.com"
JWKS_URL = "https://clerk.example.com/.well-known/jwks.json"
EVIL_URL = "https://evil.example.net/jwks.json"
SESSION_CAT = "cl_B7d4PD111AAA"


# --- keys, clock, tokens ----------------------------------------------------------------


def _rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


CLERK_KEY = _rsa_key()
ROTATED_KEY = _rsa_key()
ATTACKER_KEY = _rsa_key()


def public_pem(key: rsa.RSAPrivateKey) -> str:
    return (
        key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )


CLERK_PEM = public_pem(CLERK_KEY)


def public_jwk(key: rsa.RSAPrivateKey, kid: str, **extra: Any) -> dict[str, Any]:
    jwk: dict[str, Any] = dict(RSAAlgorithm.to_jwk(key.public_key(), as_dict=True))
    jwk.update({"kid": kid, "alg": "RS256", "use": "sig"}, **extra)
    return jwk


class FakeClock:
    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def session_claims(**overrides: Any) -> dict[str, Any]:
    claims: dict[str, Any] = {
        "azp": "https://app.example.com",
        "exp": int(NOW) + 60,
        "fva": [1, -1],
        "iat": int(NOW) - 1,
        "iss": ISSUER,
        "nbf": int(NOW) - 11,
        "sid": "sess_2abcDEF",
        "sts": "active",
        "sub": "user_2abcDEF",
        "v": 2,
    }
    for name, value in overrides.items():
        if value is _DROP:
            claims.pop(name, None)
        else:
            claims[name] = value
    return claims


_DROP = object()


def make_token(
    claims: dict[str, Any] | None = None,
    *,
    key: Any = CLERK_KEY,
    algorithm: str = "RS256",
    kid: str | None = "ins_1",
    **header: Any,
) -> str:
    headers: dict[str, Any] = {"typ": "JWT", "cat": SESSION_CAT}
    if kid is not None:
        headers["kid"] = kid
    headers.update(header)
    for name in [n for n, v in headers.items() if v is _DROP]:
        del headers[name]
    if "typ" not in headers:
        headers["typ"] = None  # PyJWT drops a falsy typ instead of adding its default
    return jwt.encode(
        session_claims() if claims is None else claims, key, algorithm=algorithm, headers=headers
    )


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def handmade_token(
    header: dict[str, Any], claims: dict[str, Any], sign: Callable[[bytes], bytes]
) -> str:
    signing_input = f"{b64url(json.dumps(header).encode())}.{b64url(json.dumps(claims).encode())}"
    return f"{signing_input}.{b64url(sign(signing_input.encode()))}"


class JwksServer:
    """A JWKS endpoint behind httpx.MockTransport that records every URL requested."""

    def __init__(self, keys: list[Any]) -> None:
        self.keys = keys
        self.requests: list[str] = []
        self.status = 200

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(str(request.url))
        if str(request.url) != JWKS_URL:
            return httpx.Response(404)
        if self.status != 200:
            return httpx.Response(self.status)
        return httpx.Response(200, json={"keys": self.keys})

    @property
    def jwks_fetches(self) -> int:
        return sum(1 for url in self.requests if url == JWKS_URL)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def verifier(clock: FakeClock) -> ClerkVerifier:
    return ClerkVerifier(pem=CLERK_PEM, clock=clock)


@pytest.fixture
def jwks_server() -> JwksServer:
    return JwksServer([public_jwk(CLERK_KEY, "ins_1")])


@pytest.fixture
async def jwks_verifier(clock: FakeClock, jwks_server: JwksServer) -> AsyncIterator[ClerkVerifier]:
    client = httpx.AsyncClient(transport=httpx.MockTransport(jwks_server.handler))
    verifier = ClerkVerifier(jwks_url=JWKS_URL, clock=clock, http_client=client)
    yield verifier
    await verifier.aclose()
    await client.aclose()


async def rejection(verifier: ClerkVerifier, token: str) -> str:
    with pytest.raises(AuthenticationFailed) as info:
        await verifier.verify(token)
    message = info.value.log_message
    assert message.startswith("jwt: ")
    assert info.value.credential_sent is True
    if len(token) >= 8:
        assert token not in message
        for segment in token.split("."):
            assert len(segment) < 8 or segment not in message
    return message


# --- accepted tokens --------------------------------------------------------------------


async def test_valid_session_token_is_accepted(verifier: ClerkVerifier) -> None:
    claims = await verifier.verify(make_token())
    assert claims == SessionClaims(
        user_id="user_2abcDEF",
        session_id="sess_2abcDEF",
        expires_at=NOW + 60,
        authorized_party="https://app.example.com",
    )


async def test_valid_session_token_is_accepted_with_jwks(jwks_verifier: ClerkVerifier) -> None:
    claims = await jwks_verifier.verify(make_token())
    assert claims.user_id == "user_2abcDEF"


async def test_token_without_azp_is_accepted_when_no_allow_list(verifier: ClerkVerifier) -> None:
    claims = await verifier.verify(make_token(session_claims(azp=_DROP)))
    assert claims.authorized_party is None


async def test_token_without_nbf_is_accepted(verifier: ClerkVerifier) -> None:
    await verifier.verify(make_token(session_claims(nbf=_DROP)))


async def test_legacy_token_without_cat_header_is_accepted(verifier: ClerkVerifier) -> None:
    await verifier.verify(make_token(cat=_DROP))


async def test_token_with_opt_out_category_is_accepted(verifier: ClerkVerifier) -> None:
    await verifier.verify(make_token(cat="cl_I7d4PD111III"))


async def test_pem_key_without_armour_or_with_escaped_newlines_is_accepted(
    clock: FakeClock,
) -> None:
    body = "".join(CLERK_PEM.strip().splitlines()[1:-1])
    for pem in (body, CLERK_PEM.replace("\n", "\\n")):
        verifier = ClerkVerifier(pem=pem, clock=clock)
        assert (await verifier.verify(make_token())).user_id == "user_2abcDEF"


def test_invalid_pem_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError):
        ClerkVerifier(pem="-----BEGIN PUBLIC KEY-----\nnot a key\n-----END PUBLIC KEY-----")


def test_non_rsa_pem_is_a_configuration_error() -> None:
    ec_pem = (
        ec.generate_private_key(ec.SECP256R1())
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )
    with pytest.raises(ConfigurationError):
        ClerkVerifier(pem=ec_pem)


# --- configuration ----------------------------------------------------------------------


async def test_unconfigured_verifier_rejects_every_token(clock: FakeClock) -> None:
    verifier = ClerkVerifier(clock=clock)
    assert not verifier.configured
    assert await rejection(verifier, make_token()) == "jwt: verifier not configured"


def test_verifier_is_configured_by_pem_or_jwks_url() -> None:
    assert ClerkVerifier(pem=CLERK_PEM).configured
    assert ClerkVerifier(jwks_url=JWKS_URL).configured


# --- signature and algorithm ------------------------------------------------------------


async def test_token_signed_by_another_key_is_rejected(verifier: ClerkVerifier) -> None:
    token = make_token(key=ATTACKER_KEY)
    assert await rejection(verifier, token) == "jwt: signature invalid"


async def test_token_with_tampered_payload_is_rejected(verifier: ClerkVerifier) -> None:
    header, _, signature = make_token().split(".")
    forged = b64url(json.dumps(session_claims(sub="user_victim")).encode())
    assert await rejection(verifier, f"{header}.{forged}.{signature}") == "jwt: signature invalid"


async def test_alg_none_is_rejected(verifier: ClerkVerifier) -> None:
    token = handmade_token(
        {"alg": "none", "typ": "JWT", "kid": "ins_1"}, session_claims(), lambda _: b""
    )
    assert await rejection(verifier, token) == "jwt: algorithm not RS256"
    assert await rejection(verifier, token.rstrip(".") + ".") == "jwt: algorithm not RS256"


async def test_hs256_signed_with_the_pem_text_is_rejected(verifier: ClerkVerifier) -> None:
    # Algorithm confusion: the attacker knows the public key and uses it as an HMAC secret.
    for secret in (CLERK_PEM.encode(), CLERK_PEM.strip().encode()):

        def sign(data: bytes, secret: bytes = secret) -> bytes:
            return hmac.new(secret, data, hashlib.sha256).digest()

        token = handmade_token(
            {"alg": "HS256", "typ": "JWT", "kid": "ins_1"}, session_claims(), sign
        )
        assert await rejection(verifier, token) == "jwt: algorithm not RS256"


async def test_es256_token_is_rejected(verifier: ClerkVerifier) -> None:
    token = make_token(key=ec.generate_private_key(ec.SECP256R1()), algorithm="ES256")
    assert await rejection(verifier, token) == "jwt: algorithm not RS256"


async def test_ps256_token_is_rejected(verifier: ClerkVerifier) -> None:
    token = make_token(algorithm="PS256")
    assert await rejection(verifier, token) == "jwt: algorithm not RS256"


async def test_rs256_signature_relabelled_as_rs512_is_rejected(verifier: ClerkVerifier) -> None:
    token = make_token(algorithm="RS512")
    assert await rejection(verifier, token) == "jwt: algorithm not RS256"


async def test_token_with_crit_header_is_rejected(verifier: ClerkVerifier) -> None:
    token = make_token(crit=["exp"])
    assert await rejection(verifier, token) == "jwt: unsupported header parameter crit"


# --- header typ and token categories ----------------------------------------------------


async def test_token_without_typ_is_rejected(verifier: ClerkVerifier) -> None:
    token = make_token(typ=_DROP)
    assert "typ" not in jwt.get_unverified_header(token)
    assert await rejection(verifier, token) == "jwt: typ header missing"


@pytest.mark.parametrize("typ", ["at+jwt", "application/at+jwt", "AT+JWT"])
async def test_oauth_access_token_typ_at_jwt_is_rejected(verifier: ClerkVerifier, typ: str) -> None:
    token = make_token(typ=typ)
    assert await rejection(verifier, token) == "jwt: oauth access token (typ at+jwt)"


@pytest.mark.parametrize("typ", ["jwt", "JWS", "dpop+jwt", 1])
async def test_typ_other_than_jwt_is_rejected(verifier: ClerkVerifier, typ: object) -> None:
    assert await rejection(verifier, make_token(typ=typ)) == "jwt: typ header not JWT"


@pytest.mark.parametrize(
    "category",
    [
        "cl_B7d4PD222AAA",  # JWT template (same signing key, can carry sub=user_… and sid)
        "cl_B7d4PD333AAA",  # M2M token
        "cl_B7d4PD999ZZZ",  # unknown future category: fail closed
        "",
        None,
    ],
)
async def test_non_session_token_category_is_rejected(
    verifier: ClerkVerifier, category: str | None
) -> None:
    assert await rejection(verifier, make_token(cat=category)) == "jwt: non-session token category"


async def test_m2m_jwt_with_machine_subject_is_rejected(verifier: ClerkVerifier) -> None:
    token = make_token(session_claims(sub="mch_2xyz"), cat=_DROP)
    assert await rejection(verifier, token) == "jwt: machine token subject (mch_)"


@pytest.mark.parametrize("prefix", ["mt_", "oat_", "ak_"])
async def test_opaque_clerk_machine_token_is_rejected(verifier: ClerkVerifier, prefix: str) -> None:
    token = prefix + "2abcdefghijklmnopqrstuvwxyz0123456789"
    assert await rejection(verifier, token) == "jwt: opaque clerk machine token"


# --- required claims and times ----------------------------------------------------------


@pytest.mark.parametrize("claim", ["exp", "iat", "sub", "sid"])
async def test_token_missing_a_required_claim_is_rejected(
    verifier: ClerkVerifier, claim: str
) -> None:
    token = make_token(session_claims(**{claim: _DROP}))
    assert await rejection(verifier, token) == f"jwt: missing claim {claim}"


@pytest.mark.parametrize("claim", ["exp", "iat", "nbf"])
@pytest.mark.parametrize("value", ["1750000060", True, [1], {"a": 1}])
async def test_time_claim_that_is_not_a_number_is_rejected(
    verifier: ClerkVerifier, claim: str, value: object
) -> None:
    token = make_token(session_claims(**{claim: value}))
    assert await rejection(verifier, token) == f"jwt: claim {claim} not a number"


@pytest.mark.parametrize("claim", ["sub", "sid"])
@pytest.mark.parametrize("value", ["", 123, ["user_x"]])
async def test_identity_claim_that_is_not_a_string_is_rejected(
    verifier: ClerkVerifier, claim: str, value: object
) -> None:
    token = make_token(session_claims(**{claim: value}))
    assert await rejection(verifier, token) == f"jwt: claim {claim} not a string"


async def test_expired_token_is_rejected_after_leeway(
    verifier: ClerkVerifier, clock: FakeClock
) -> None:
    token = make_token(session_claims(exp=int(NOW) - 5))
    assert await rejection(verifier, token) == "jwt: token expired"


async def test_expired_token_within_leeway_is_accepted(verifier: ClerkVerifier) -> None:
    token = make_token(session_claims(exp=int(NOW) - 4))
    assert (await verifier.verify(token)).expires_at == NOW - 4


async def test_leeway_is_configurable(clock: FakeClock) -> None:
    strict = ClerkVerifier(pem=CLERK_PEM, clock=clock, leeway_seconds=0)
    token = make_token(session_claims(exp=int(NOW)))
    assert await rejection(strict, token) == "jwt: token expired"


async def test_token_with_future_nbf_is_rejected(verifier: ClerkVerifier) -> None:
    token = make_token(session_claims(nbf=int(NOW) + 6))
    assert await rejection(verifier, token) == "jwt: token not yet valid (nbf)"


async def test_token_with_nbf_within_leeway_is_accepted(verifier: ClerkVerifier) -> None:
    await verifier.verify(make_token(session_claims(nbf=int(NOW) + 5)))


async def test_token_issued_in_the_future_is_rejected(verifier: ClerkVerifier) -> None:
    token = make_token(session_claims(iat=int(NOW) + 6, nbf=_DROP))
    assert await rejection(verifier, token) == "jwt: token issued in the future (iat)"


async def test_token_issued_within_leeway_of_now_is_accepted(verifier: ClerkVerifier) -> None:
    await verifier.verify(make_token(session_claims(iat=int(NOW) + 5, nbf=_DROP)))


# --- subject, issuer, authorized party, status ------------------------------------------


@pytest.mark.parametrize("sub", ["usr_2abc", "org_2abc", "User_2abc", "2abc", "user"])
async def test_subject_that_is_not_a_user_is_rejected(verifier: ClerkVerifier, sub: str) -> None:
    token = make_token(session_claims(sub=sub))
    assert await rejection(verifier, token) == "jwt: subject is not a user"


async def test_token_from_wrong_issuer_is_rejected(clock: FakeClock) -> None:
    verifier = ClerkVerifier(pem=CLERK_PEM, issuer=ISSUER, clock=clock)
    await verifier.verify(make_token())
    token = make_token(session_claims(iss="https://clerk.other.example.com"))
    assert await rejection(verifier, token) == "jwt: issuer mismatch"


async def test_token_without_iss_is_rejected_when_issuer_is_configured(clock: FakeClock) -> None:
    verifier = ClerkVerifier(pem=CLERK_PEM, issuer=ISSUER, clock=clock)
    token = make_token(session_claims(iss=_DROP))
    assert await rejection(verifier, token) == "jwt: missing claim iss"


async def test_any_issuer_is_accepted_when_none_is_configured(verifier: ClerkVerifier) -> None:
    await verifier.verify(make_token(session_claims(iss="https://clerk.other.example.com")))


async def test_azp_outside_allow_list_is_rejected(clock: FakeClock) -> None:
    verifier = ClerkVerifier(
        pem=CLERK_PEM, clock=clock, authorized_parties=frozenset({"https://app.example.com"})
    )
    await verifier.verify(make_token())
    token = make_token(session_claims(azp="https://evil.example.net"))
    assert await rejection(verifier, token) == "jwt: azp not allowed"


async def test_token_without_azp_is_rejected_when_allow_list_is_set(clock: FakeClock) -> None:
    verifier = ClerkVerifier(
        pem=CLERK_PEM, clock=clock, authorized_parties=frozenset({"https://app.example.com"})
    )
    token = make_token(session_claims(azp=_DROP))
    assert await rejection(verifier, token) == "jwt: missing claim azp"


async def test_non_string_azp_is_rejected(verifier: ClerkVerifier) -> None:
    token = make_token(session_claims(azp=["https://app.example.com"]))
    assert await rejection(verifier, token) == "jwt: claim azp not a string"


async def test_pending_session_is_rejected(verifier: ClerkVerifier) -> None:
    token = make_token(session_claims(sts="pending"))
    assert await rejection(verifier, token) == "jwt: session pending"


async def test_v1_token_without_sts_is_accepted(verifier: ClerkVerifier) -> None:
    await verifier.verify(make_token(session_claims(sts=_DROP, v=_DROP, fva=_DROP)))


# --- malformed input --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("token", "reason"),
    [
        ("", "jwt: malformed token"),
        ("not-a-jwt", "jwt: malformed token"),
        ("a.b", "jwt: malformed token"),
        ("a.b.c.d", "jwt: malformed token"),
        ("!!!!.e30.c2ln", "jwt: malformed header"),
        (f"{b64url(b'[1, 2]')}.e30.c2ln", "jwt: malformed header"),
        (f"{b64url(b'{not json')}.e30.c2ln", "jwt: malformed header"),
    ],
)
async def test_malformed_token_is_rejected(
    verifier: ClerkVerifier, token: str, reason: str
) -> None:
    assert await rejection(verifier, token) == reason


async def test_token_with_invalid_payload_encoding_is_rejected(verifier: ClerkVerifier) -> None:
    header, _, signature = make_token().split(".")
    assert await rejection(verifier, f"{header}.@@@@.{signature}") == "jwt: malformed token"


async def test_signed_payload_that_is_not_an_object_is_rejected(verifier: ClerkVerifier) -> None:
    token = jwt.api_jws.encode(
        b"[1, 2, 3]", CLERK_KEY, algorithm="RS256", headers={"kid": "ins_1", "typ": "JWT"}
    )
    assert await rejection(verifier, token) == "jwt: payload not an object"


async def test_signed_payload_that_is_not_json_is_rejected(verifier: ClerkVerifier) -> None:
    token = jwt.api_jws.encode(
        b"\xff not json", CLERK_KEY, algorithm="RS256", headers={"kid": "ins_1", "typ": "JWT"}
    )
    assert await rejection(verifier, token) == "jwt: payload not json"


async def test_oversized_token_is_rejected(verifier: ClerkVerifier) -> None:
    token = make_token(session_claims(padding="x" * 10_000))
    assert await rejection(verifier, token) == "jwt: token too long"


async def test_non_ascii_token_is_rejected(verifier: ClerkVerifier) -> None:
    assert await rejection(verifier, make_token() + "é") == "jwt: token not ascii"
    assert await rejection(verifier, "\ud800.e30.c2ln") == "jwt: token not ascii"


# --- JWKS -------------------------------------------------------------------------------


async def test_jwks_is_fetched_once_and_cached(
    jwks_verifier: ClerkVerifier, jwks_server: JwksServer, clock: FakeClock
) -> None:
    for index in range(5):
        await jwks_verifier.verify(make_token(session_claims(sid=f"sess_{index}")))
        clock.advance(1)
    assert jwks_server.jwks_fetches == 1
    assert jwks_verifier.stats.jwks_fetches == 1
    assert jwks_verifier.stats.decodes == 5


async def test_concurrent_first_requests_share_one_jwks_fetch(
    jwks_verifier: ClerkVerifier, jwks_server: JwksServer
) -> None:
    tokens = [make_token(session_claims(sid=f"sess_{i}")) for i in range(20)]
    results = await asyncio.gather(*(jwks_verifier.verify(t) for t in tokens))
    assert len(results) == 20
    assert jwks_server.jwks_fetches == 1


async def test_unknown_kid_triggers_jwks_refetch(
    jwks_verifier: ClerkVerifier, jwks_server: JwksServer, clock: FakeClock
) -> None:
    await jwks_verifier.verify(make_token())
    jwks_server.keys = [public_jwk(CLERK_KEY, "ins_1"), public_jwk(ROTATED_KEY, "ins_2")]
    clock.advance(JWKS_MIN_REFETCH_SECONDS)
    rotated = make_token(session_claims(sid="sess_rotated"), key=ROTATED_KEY, kid="ins_2")
    assert (await jwks_verifier.verify(rotated)).session_id == "sess_rotated"
    assert jwks_server.jwks_fetches == 2


async def test_unknown_kid_refetch_is_throttled(
    jwks_verifier: ClerkVerifier, jwks_server: JwksServer, clock: FakeClock
) -> None:
    await jwks_verifier.verify(make_token())
    assert jwks_server.jwks_fetches == 1
    clock.advance(JWKS_MIN_REFETCH_SECONDS)
    for index in range(50):
        token = make_token(key=ATTACKER_KEY, kid=f"ins_unknown_{index}")
        assert await rejection(jwks_verifier, token) == "jwt: unknown kid"
        clock.advance(0.5)
    # One refetch for the whole flood: the others fell inside the 30 s window.
    assert jwks_server.jwks_fetches == 2
    clock.advance(JWKS_MIN_REFETCH_SECONDS)
    await rejection(jwks_verifier, make_token(key=ATTACKER_KEY, kid="ins_unknown_x"))
    assert jwks_server.jwks_fetches == 3
    # Known keys keep working throughout.
    fresh = session_claims(sid="sess_after", exp=int(clock.now) + 60, iat=int(clock.now))
    await jwks_verifier.verify(make_token(fresh))
    assert jwks_server.jwks_fetches == 3


async def test_token_header_urls_and_keys_are_never_used(
    jwks_verifier: ClerkVerifier, jwks_server: JwksServer
) -> None:
    attacker_jwk = public_jwk(ATTACKER_KEY, "ins_evil")
    forged = make_token(
        key=ATTACKER_KEY,
        kid="ins_evil",
        jku=EVIL_URL,
        x5u=EVIL_URL,
        jwk=attacker_jwk,
    )
    assert await rejection(jwks_verifier, forged) == "jwt: unknown kid"
    # Same, but reusing the genuine kid: the configured key decides, so the signature fails.
    forged_same_kid = make_token(key=ATTACKER_KEY, kid="ins_1", jku=EVIL_URL, jwk=attacker_jwk)
    assert await rejection(jwks_verifier, forged_same_kid) == "jwt: signature invalid"
    # A genuine token that happens to carry jku still verifies against the configured JWKS.
    await jwks_verifier.verify(make_token(jku=EVIL_URL, x5u=EVIL_URL))
    assert set(jwks_server.requests) == {JWKS_URL}


async def test_token_without_kid_is_rejected_with_jwks(jwks_verifier: ClerkVerifier) -> None:
    assert await rejection(jwks_verifier, make_token(kid=None)) == "jwt: kid missing"


async def test_pem_key_ignores_kid(verifier: ClerkVerifier) -> None:
    await verifier.verify(make_token(kid=None))
    await verifier.verify(make_token(session_claims(sid="sess_other"), kid="anything"))


async def test_jwks_outage_rejects_and_recovers_after_throttle(
    jwks_verifier: ClerkVerifier, jwks_server: JwksServer, clock: FakeClock
) -> None:
    jwks_server.status = 503
    assert await rejection(jwks_verifier, make_token()) == "jwt: jwks unavailable"
    jwks_server.status = 200
    assert await rejection(jwks_verifier, make_token()) == "jwt: jwks unavailable"
    assert jwks_server.jwks_fetches == 1
    clock.advance(JWKS_MIN_REFETCH_SECONDS)
    await jwks_verifier.verify(make_token())
    assert jwks_server.jwks_fetches == 2


async def test_jwks_with_garbage_body_is_treated_as_unavailable(clock: FakeClock) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"<html>not json</html>")

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        verifier = ClerkVerifier(jwks_url=JWKS_URL, clock=clock, http_client=client)
        assert await rejection(verifier, make_token()) == "jwt: jwks unavailable"


async def test_jwks_keys_for_other_algorithms_are_ignored(
    jwks_verifier: ClerkVerifier, jwks_server: JwksServer
) -> None:
    jwks_server.keys = [
        public_jwk(CLERK_KEY, "ins_enc", use="enc"),
        public_jwk(CLERK_KEY, "ins_ps", alg="PS256"),
        {"kty": "oct", "kid": "ins_hmac", "k": b64url(CLERK_PEM.encode())},
        "not a key",
        public_jwk(CLERK_KEY, "ins_1"),
    ]
    await jwks_verifier.verify(make_token())
    for kid in ("ins_enc", "ins_ps", "ins_hmac"):
        assert await rejection(jwks_verifier, make_token(kid=kid)) == "jwt: unknown kid"


async def test_jwks_is_refreshed_when_it_reaches_max_age(
    jwks_verifier: ClerkVerifier, jwks_server: JwksServer, clock: FakeClock
) -> None:
    await jwks_verifier.verify(make_token())
    jwks_server.keys = [public_jwk(ROTATED_KEY, "ins_2")]  # ins_1 withdrawn
    clock.advance(JWKS_MAX_AGE_SECONDS)
    token = make_token(session_claims(exp=int(clock.now) + 60, iat=int(clock.now)))
    assert await rejection(jwks_verifier, token) == "jwt: unknown kid"
    assert jwks_server.jwks_fetches == 2


# --- verified-token cache ---------------------------------------------------------------


async def test_second_verify_of_same_token_does_not_decode_again(
    verifier: ClerkVerifier, clock: FakeClock
) -> None:
    token = make_token()
    first = await verifier.verify(token)
    clock.advance(10)
    second = await verifier.verify(token)
    assert first == second
    assert verifier.stats.decodes == 1
    assert verifier.stats.cache_hits == 1


async def test_cached_token_is_rejected_once_exp_plus_leeway_passes(
    verifier: ClerkVerifier, clock: FakeClock
) -> None:
    token = make_token()  # exp = NOW + 60
    await verifier.verify(token)
    clock.now = NOW + 59.9
    await verifier.verify(token)
    assert verifier.stats.decodes == 1
    clock.now = NOW + 62  # past exp, inside leeway: still accepted, but re-verified
    await verifier.verify(token)
    assert verifier.stats.decodes == 2
    clock.now = NOW + 65  # exp + leeway
    assert await rejection(verifier, token) == "jwt: token expired"


async def test_cached_token_is_not_served_when_clock_moves_before_issue(
    verifier: ClerkVerifier, clock: FakeClock
) -> None:
    token = make_token(session_claims(nbf=_DROP))  # iat = NOW - 1
    await verifier.verify(token)
    clock.now = NOW - 10
    assert await rejection(verifier, token) == "jwt: token issued in the future (iat)"


async def test_rejected_tokens_are_not_cached(verifier: ClerkVerifier) -> None:
    token = make_token(key=ATTACKER_KEY)
    await rejection(verifier, token)
    await rejection(verifier, token)
    assert verifier.stats.decodes == 2
    assert verifier.stats.cache_hits == 0


async def test_token_cache_is_bounded(clock: FakeClock) -> None:
    verifier = ClerkVerifier(pem=CLERK_PEM, clock=clock, cache_size=2)
    tokens = [make_token(session_claims(sid=f"sess_{i}")) for i in range(3)]
    for token in tokens:
        await verifier.verify(token)
    assert verifier.stats.decodes == 3
    await verifier.verify(tokens[2])  # still cached
    assert verifier.stats.decodes == 3
    await verifier.verify(tokens[0])  # evicted
    assert verifier.stats.decodes == 4


async def test_cache_can_be_disabled(clock: FakeClock) -> None:
    verifier = ClerkVerifier(pem=CLERK_PEM, clock=clock, cache_size=0)
    token = make_token()
    await verifier.verify(token)
    await verifier.verify(token)
    assert verifier.stats.decodes == 2


async def test_owned_http_client_is_closed_by_aclose(clock: FakeClock) -> None:
    verifier = ClerkVerifier(jwks_url="http://127.0.0.1:9/jwks.json", clock=clock)
    assert await rejection(verifier, make_token()) == "jwt: jwks unavailable"
    await verifier.aclose()
    await verifier.aclose()


# --- properties -------------------------------------------------------------------------

_HYPOTHESIS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@_HYPOTHESIS
@given(text=st.text(max_size=300))
async def test_arbitrary_text_raises_only_authentication_failed(text: str) -> None:
    verifier = ClerkVerifier(pem=CLERK_PEM, clock=FakeClock())
    with pytest.raises(AuthenticationFailed):
        await verifier.verify(text)


@_HYPOTHESIS
@given(
    segments=st.lists(
        st.binary(max_size=64).map(b64url) | st.text(alphabet="abcXYZ019-_=+/.", max_size=40),
        min_size=1,
        max_size=4,
    )
)
async def test_jwt_shaped_garbage_raises_only_authentication_failed(segments: list[str]) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"keys": [public_jwk(CLERK_KEY, "ins_1")]})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        verifier = ClerkVerifier(jwks_url=JWKS_URL, clock=FakeClock(), http_client=client)
        with pytest.raises(AuthenticationFailed):
            await verifier.verify(".".join(segments))


@_HYPOTHESIS
@given(
    header=st.dictionaries(
        st.sampled_from(["alg", "typ", "kid", "cat", "crit", "b64", "jku"]), json_values
    ),
    claims=st.dictionaries(st.text(max_size=5), json_values),
)
async def test_arbitrary_json_header_and_claims_raise_only_authentication_failed(
    header: dict[str, Any], claims: dict[str, Any]
) -> None:
    verifier = ClerkVerifier(pem=CLERK_PEM, clock=FakeClock())
    token = handmade_token(header, claims, lambda _: b"sig")
    with pytest.raises(AuthenticationFailed):
        await verifier.verify(token)


@_HYPOTHESIS
@given(
    overrides=st.dictionaries(
        st.sampled_from(["exp", "iat", "nbf", "sub", "sid", "azp", "sts", "iss"]), json_values
    )
)
async def test_validly_signed_odd_claims_verify_or_raise_only_authentication_failed(
    overrides: dict[str, Any],
) -> None:
    verifier = ClerkVerifier(
        pem=CLERK_PEM,
        clock=FakeClock(),
        issuer=ISSUER,
        authorized_parties=frozenset({"https://app.example.com"}),
    )
    claims = session_claims()
    claims.update(overrides)
    try:
        token = make_token(claims)
    except (TypeError, ValueError):  # floats like NaN are not JSON PyJWT will write
        return
    try:
        result = await verifier.verify(token)
    except AuthenticationFailed:
        return
    assert result.user_id.startswith("user_")
    assert isinstance(result.session_id, str)
    assert result.authorized_party == "https://app.example.com"

"""API keys: ``ivy_<kid>_<secret><checksum>``, GitHub-token style.

Layout (53 characters, all base62 ``[0-9A-Za-z]`` apart from the prefix and the separator)::

    ivy_ XXXXXXXXXXXX _ YYYYYYYYYYYYYYYYYYYYYYYYYYYYYY ZZZZZZ
    |    kid (12)       random secret (30)             CRC32 of everything before it,
    prefix                                             base62, zero-padded to 6

The ``kid`` is the public lookup id (safe to log and to index). The checksum lets us reject
typos and random garbage without touching the database; it is *not* a secret and offers no
security by itself — the stored ``HMAC-SHA256(pepper, key)`` and a constant-time compare do.

Everything here is pure and cheap: :func:`parse_api_key` runs on every request that carries a
key, so it uses ``str`` methods and :func:`zlib.crc32` only (no regex, no allocation beyond the
result).
"""

from __future__ import annotations

import hmac
import secrets
import zlib
from dataclasses import dataclass

from ivy_sandbox.errors import AuthenticationFailed

__all__ = [
    "API_KEY_LENGTH",
    "API_KEY_PREFIX",
    "ParsedApiKey",
    "digests_equal",
    "generate_api_key",
    "hash_api_key",
    "looks_like_api_key",
    "parse_api_key",
]

API_KEY_PREFIX = "ivy_"

_BASE62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_KID_LENGTH = 12
_SECRET_LENGTH = 30
_CHECKSUM_LENGTH = 6  # 62**6 > 2**32, so any CRC32 fits

_KID_START = len(API_KEY_PREFIX)  # 4
_KID_END = _KID_START + _KID_LENGTH  # 16 (the "_" separator sits here)
_BODY_START = _KID_END + 1  # 17
_CHECKSUM_START = _BODY_START + _SECRET_LENGTH  # 47
API_KEY_LENGTH = _CHECKSUM_START + _CHECKSUM_LENGTH  # 53


@dataclass(frozen=True, slots=True)
class ParsedApiKey:
    """A well-formed key: ``kid`` is safe to log, ``raw`` is the secret itself."""

    kid: str
    raw: str

    def __repr__(self) -> str:  # never let the secret reach a log through repr()
        return f"ParsedApiKey(kid={self.kid!r}, raw='***')"


def _random_base62(length: int) -> str:
    return "".join(secrets.choice(_BASE62) for _ in range(length))


def _checksum(signed_part: str) -> str:
    """Base62 of ``crc32(signed_part)``, zero-padded to exactly six characters."""
    value = zlib.crc32(signed_part.encode("ascii"))
    digits = ["0"] * _CHECKSUM_LENGTH
    for position in range(_CHECKSUM_LENGTH - 1, -1, -1):
        value, digit = divmod(value, 62)
        digits[position] = _BASE62[digit]
    return "".join(digits)


def generate_api_key() -> ParsedApiKey:
    """A fresh key with a random ``kid`` and 30 random base62 characters (~178 bits)."""
    kid = _random_base62(_KID_LENGTH)
    signed_part = f"{API_KEY_PREFIX}{kid}_{_random_base62(_SECRET_LENGTH)}"
    return ParsedApiKey(kid=kid, raw=signed_part + _checksum(signed_part))


def parse_api_key(raw: str) -> ParsedApiKey:
    """Check the format and checksum; raise :class:`AuthenticationFailed` when either is wrong.

    The log messages name the reason only, never the key text.
    """
    if not raw.startswith(API_KEY_PREFIX):
        raise AuthenticationFailed(log_message="api key prefix invalid")
    if len(raw) != API_KEY_LENGTH:
        raise AuthenticationFailed(log_message="api key length invalid")
    if raw[_KID_END] != "_":
        raise AuthenticationFailed(log_message="api key separator invalid")
    # isalnum() alone would accept any Unicode letter or digit; isascii() narrows it to base62.
    kid = raw[_KID_START:_KID_END]
    if not (raw.isascii() and kid.isalnum() and raw[_BODY_START:].isalnum()):
        raise AuthenticationFailed(log_message="api key alphabet invalid")
    if raw[_CHECKSUM_START:] != _checksum(raw[:_CHECKSUM_START]):
        raise AuthenticationFailed(log_message="api key checksum mismatch")
    return ParsedApiKey(kid=kid, raw=raw)


def looks_like_api_key(value: str) -> bool:
    """Cheap routing test: does this credential claim to be one of our keys?"""
    return value.startswith(API_KEY_PREFIX)


def hash_api_key(pepper: bytes, raw: str) -> bytes:
    """``HMAC-SHA256(pepper, raw)``: the only form of a key that is ever stored (32 bytes)."""
    return hmac.digest(pepper, raw.encode("utf-8"), "sha256")


def digests_equal(a: bytes, b: bytes) -> bool:
    """Constant-time comparison of two digests."""
    return hmac.compare_digest(a, b)

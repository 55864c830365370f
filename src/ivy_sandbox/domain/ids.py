"""Identifiers: how we make them and which ones we accept."""

from __future__ import annotations

import re
import secrets

BASE62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
MAX_ID_LENGTH = 64

# Ids we accept from outside (path parameters, admin input): letters, digits, '_' and '-',
# starting with a letter or digit, at most 64 characters. Anything else cannot name a row.
_ACCEPTED_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


def random_base62(length: int) -> str:
    return "".join(secrets.choice(BASE62) for _ in range(length))


def new_id(prefix: str) -> str:
    """A new random id such as ``chat_3kTq…`` (prefix + 20 base62 chars, ~119 bits)."""
    return f"{prefix}_{random_base62(20)}"


def is_acceptable_id(value: str) -> bool:
    return _ACCEPTED_ID.fullmatch(value) is not None

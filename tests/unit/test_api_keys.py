"""API key format, checksum, parsing and hashing (ivy_sandbox.auth.api_keys)."""

from __future__ import annotations

import hashlib
import hmac
import string
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ivy_sandbox.auth.api_keys import (
    API_KEY_PREFIX,
    ParsedApiKey,
    digests_equal,
    generate_api_key,
    hash_api_key,
    looks_like_api_key,
    parse_api_key,
)
from ivy_sandbox.errors import AuthenticationFailed

BASE62 = string.digits + string.ascii_uppercase + string.ascii_lowercase


def reference_checksum(signed_part: str) -> str:
    """Independent base62 of CRC32, zero-padded to 6 (most significant digit first)."""
    value = zlib.crc32(signed_part.encode())
    out = ""
    while value:
        out = BASE62[value % 62] + out
        value //= 62
    return out.rjust(6, "0")


def rejection(raw: str) -> str:
    with pytest.raises(AuthenticationFailed) as info:
        parse_api_key(raw)
    assert info.value.credential_sent is True
    return info.value.log_message


def replace_at(raw: str, index: int, char: str) -> str:
    return raw[:index] + char + raw[index + 1 :]


def other_base62(char: str) -> str:
    return BASE62[(BASE62.index(char) + 1) % 62]


# --- format -----------------------------------------------------------------------------


def test_generated_key_has_documented_layout() -> None:
    key = generate_api_key()
    raw = key.raw
    assert len(raw) == 53
    assert raw.startswith("ivy_")
    assert raw[16] == "_"
    assert key.kid == raw[4:16]
    assert all(c in BASE62 for c in raw[4:16] + raw[17:])
    assert raw[47:] == reference_checksum(raw[:47])


def test_generated_key_roundtrips_through_parse() -> None:
    key = generate_api_key()
    assert parse_api_key(key.raw) == ParsedApiKey(kid=key.kid, raw=key.raw)


def test_generated_keys_are_unique() -> None:
    keys = {generate_api_key().raw for _ in range(200)}
    kids = {k[4:16] for k in keys}
    assert len(keys) == 200
    assert len(kids) == 200


def test_checksum_is_zero_padded_to_fixed_width() -> None:
    # About 1 in 5 CRC32 values needs fewer than six base62 digits.
    for _ in range(500):
        key = generate_api_key()
        if key.raw[47] == "0":
            break
    else:  # pragma: no cover - probability ~1e-50
        pytest.fail("no key with a short checksum generated")
    assert len(key.raw) == 53
    assert parse_api_key(key.raw).kid == key.kid


def test_repr_of_parsed_key_hides_the_secret() -> None:
    key = generate_api_key()
    assert key.raw not in repr(key)
    assert key.kid in repr(key)


def test_looks_like_api_key_is_a_prefix_test() -> None:
    assert looks_like_api_key(generate_api_key().raw)
    assert looks_like_api_key("ivy_")
    assert not looks_like_api_key("eyJhbGciOiJSUzI1NiJ9.e30.sig")
    assert not looks_like_api_key("IVY_abc")
    assert API_KEY_PREFIX == "ivy_"


# --- malformed keys ---------------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["ivx_", "IVY_", "ak__", "ivy-"])
def test_key_with_wrong_prefix_is_rejected(prefix: str) -> None:
    raw = prefix + generate_api_key().raw[4:]
    assert rejection(raw) == "api key prefix invalid"


@pytest.mark.parametrize("delta", [-1, 1, -30, 100])
def test_key_with_wrong_length_is_rejected(delta: int) -> None:
    raw = generate_api_key().raw
    raw = raw[:delta] if delta < 0 else raw + "a" * delta
    assert rejection(raw) == "api key length invalid"


def test_empty_and_prefix_only_keys_are_rejected() -> None:
    assert rejection("") == "api key prefix invalid"
    assert rejection("ivy_") == "api key length invalid"


def test_key_with_wrong_separator_is_rejected() -> None:
    raw = replace_at(generate_api_key().raw, 16, "a")
    assert rejection(raw) == "api key separator invalid"


@pytest.mark.parametrize("index", [4, 15, 17, 40, 52])
@pytest.mark.parametrize("char", ["-", "_", "+", "/", "=", " ", "\x00"])
def test_key_with_ascii_character_outside_base62_is_rejected(index: int, char: str) -> None:
    raw = replace_at(generate_api_key().raw, index, char)
    assert rejection(raw) == "api key alphabet invalid"


@pytest.mark.parametrize("char", ["é", "٣", "\uff21", "ß"])
def test_key_with_unicode_alphanumeric_is_rejected(char: str) -> None:
    # str.isalnum() accepts these; the base62 check must not.
    raw = replace_at(generate_api_key().raw, 20, char)
    assert len(raw) == 53
    assert rejection(raw) == "api key alphabet invalid"


def test_any_single_flipped_character_fails_the_checksum() -> None:
    raw = generate_api_key().raw
    for index in [*range(4, 16), *range(17, 53)]:
        flipped = replace_at(raw, index, other_base62(raw[index]))
        assert rejection(flipped) == "api key checksum mismatch", index


def test_swapped_case_fails_the_checksum() -> None:
    raw = generate_api_key().raw
    index = next(i for i in range(17, 47) if raw[i].isalpha())
    flipped = replace_at(raw, index, raw[index].swapcase())
    assert rejection(flipped) == "api key checksum mismatch"


def test_rejection_log_messages_never_contain_the_key() -> None:
    raw = generate_api_key().raw
    candidates = [
        "x" + raw[1:],
        raw + "x",
        replace_at(raw, 16, "x"),
        replace_at(raw, 30, "-"),
        replace_at(raw, 30, other_base62(raw[30])),
    ]
    for candidate in candidates:
        message = rejection(candidate)
        assert candidate not in message
        assert candidate[4:16] not in message
        assert candidate[17:] not in message


# --- hashing ----------------------------------------------------------------------------


def test_hash_is_hmac_sha256_of_the_key() -> None:
    raw = generate_api_key().raw
    pepper = b"pepper-one"
    digest = hash_api_key(pepper, raw)
    assert len(digest) == 32
    assert digest == hmac.new(pepper, raw.encode(), hashlib.sha256).digest()
    assert digest == hash_api_key(pepper, raw)


def test_hash_differs_per_pepper() -> None:
    raw = generate_api_key().raw
    assert hash_api_key(b"pepper-one", raw) != hash_api_key(b"pepper-two", raw)


def test_hash_differs_per_key() -> None:
    pepper = b"pepper"
    assert hash_api_key(pepper, generate_api_key().raw) != hash_api_key(
        pepper, generate_api_key().raw
    )


def test_digests_equal_compares_exactly() -> None:
    raw = generate_api_key().raw
    a = hash_api_key(b"p", raw)
    assert digests_equal(a, hash_api_key(b"p", raw))
    assert not digests_equal(a, hash_api_key(b"q", raw))
    assert not digests_equal(a, a[:-1])
    assert not digests_equal(a, b"")


# --- properties -------------------------------------------------------------------------


@given(st.text(max_size=120))
def test_parse_of_arbitrary_text_raises_only_authentication_failed(text: str) -> None:
    try:
        parsed = parse_api_key(text)
    except AuthenticationFailed as exc:
        message = exc.log_message
    else:
        assert parsed.raw == text
        return
    assert message.startswith("api key ")
    assert len(text) < 30 or text not in message


@given(st.text(alphabet=BASE62 + "_-é٣", min_size=49, max_size=49))
def test_parse_of_key_shaped_text_raises_only_authentication_failed(body: str) -> None:
    text = "ivy_" + body
    try:
        parsed = parse_api_key(text)
    except AuthenticationFailed:
        pass
    else:
        assert parsed.raw[47:] == reference_checksum(parsed.raw[:47])


@given(st.integers(min_value=4, max_value=52), st.sampled_from(BASE62))
def test_single_substitution_in_a_valid_key_is_always_rejected(index: int, char: str) -> None:
    raw = generate_api_key().raw
    if raw[index] == char or index == 16:
        return
    with pytest.raises(AuthenticationFailed):
        parse_api_key(replace_at(raw, index, char))

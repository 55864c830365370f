"""Which credential a request carries, decided from headers alone (DESIGN §3 order)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ivy_sandbox.auth.credentials import CredentialType, extract_credential, session_cookie
from ivy_sandbox.errors import AuthenticationFailed

KEY = "ivy_abcdefghijkl_" + "x" * 36
JWT = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ1c2VyXzEifQ.sig"


def test_api_key_header_is_an_api_key() -> None:
    credential = extract_credential(None, KEY, None)
    assert (credential.type, credential.value) == (CredentialType.API_KEY, KEY)


def test_bearer_ivy_key_is_an_api_key_whatever_the_scheme_case() -> None:
    for header in (f"Bearer {KEY}", f"bearer {KEY}", f"BEARER   {KEY}  "):
        assert extract_credential(header, None, None).type is CredentialType.API_KEY


def test_bearer_non_key_is_a_session_token() -> None:
    credential = extract_credential(f"Bearer {JWT}", None, None)
    assert (credential.type, credential.value) == (CredentialType.SESSION_TOKEN, JWT)


def test_session_cookie_is_used_only_without_auth_headers() -> None:
    cookie = f"__session={JWT}"
    assert extract_credential(None, None, cookie).value == JWT
    assert extract_credential(f"Bearer {KEY}", None, cookie).type is CredentialType.API_KEY
    assert extract_credential(None, KEY, cookie).type is CredentialType.API_KEY


def test_invalid_authorization_header_is_not_rescued_by_a_valid_cookie() -> None:
    with pytest.raises(AuthenticationFailed) as caught:
        extract_credential("Basic abc", None, f"__session={JWT}")
    assert caught.value.credential_sent is True


def test_no_credential_is_reported_as_not_sent() -> None:
    for cookie in (None, "", "theme=dark", "__session=", "__sessionx=1"):
        with pytest.raises(AuthenticationFailed) as caught:
            extract_credential(None, None, cookie)
        assert caught.value.credential_sent is False


def test_suffixed_session_cookie_is_found_and_the_plain_one_preferred() -> None:
    assert session_cookie(f"a=1; __session_Xy9={JWT}") == JWT
    assert session_cookie(f"__session_Xy9=other; __session={JWT}") == JWT


def test_two_different_keys_in_two_headers_are_rejected() -> None:
    with pytest.raises(AuthenticationFailed):
        extract_credential(f"Bearer {KEY}x", KEY, None)


def test_oversized_credential_is_rejected_before_verification() -> None:
    with pytest.raises(AuthenticationFailed):
        extract_credential("Bearer " + "a" * 9000, None, None)


@given(
    authorization=st.none() | st.text(max_size=300),
    api_key=st.none() | st.text(max_size=100),
    cookie=st.none() | st.text(max_size=300),
)
def test_arbitrary_headers_yield_a_credential_or_authentication_failed_only(
    authorization: str | None, api_key: str | None, cookie: str | None
) -> None:
    try:
        credential = extract_credential(authorization, api_key, cookie)
    except AuthenticationFailed:
        return
    assert isinstance(credential.value, str)

"""Typed errors of the SDK, one per documented failure of the API.

::

    IvySandboxClientError             every error the SDK raises
    ├── APIConnectionError            the server could not be reached (or the answer was cut)
    ├── APIStatusError                any other non-2xx answer (status_code, code, detail)
    │   ├── AuthenticationError       401 (also: the credential stopped working mid-stream)
    │   ├── PermissionDeniedError     403
    │   ├── ConflictError             409 (e.g. exec while the sandbox is not active)
    │   └── RateLimitError            429 that could not be waited out (retry_after seconds)
    ├── SandboxFailedError            the sandbox ended `failed` (error_code, error_message)
    ├── NoSandboxError                waiting on a chat that has no sandbox (status `none`)
    └── TimeoutError                  waiting took longer than asked (also a builtin TimeoutError)
"""

from __future__ import annotations

import builtins


class IvySandboxClientError(Exception):
    """Base class of every error the SDK raises."""


class APIConnectionError(IvySandboxClientError):
    """The request did not get an answer: connection refused, reset, or timed out."""


class APIStatusError(IvySandboxClientError):
    """The server answered with an error status; ``code`` and ``detail`` come from its body."""

    def __init__(self, status_code: int, code: str, detail: str) -> None:
        super().__init__(f"{status_code} {code}: {detail}")
        self.status_code = status_code
        self.code = code
        self.detail = detail


class AuthenticationError(APIStatusError):
    """401: no credential, or one that is unknown, expired or revoked."""


class PermissionDeniedError(APIStatusError):
    """403: the chat does not exist or is not yours (the API does not say which)."""


class ConflictError(APIStatusError):
    """409: the request does not fit the sandbox's state (exec or keep-alive when not active)."""


class RateLimitError(APIStatusError):
    """429: too many requests; ``retry_after`` is the number of seconds the server asked for."""

    def __init__(self, status_code: int, code: str, detail: str, retry_after: float) -> None:
        super().__init__(status_code, code, detail)
        self.retry_after = retry_after


class SandboxFailedError(IvySandboxClientError):
    """The sandbox ended ``failed``: ``error_code`` (e.g. ``mount_failed``, from the sandbox's
    record; ``None`` if it could not be read) and ``error_message`` (from the status body)."""

    def __init__(self, error_code: str | None, error_message: str) -> None:
        super().__init__(f"sandbox failed ({error_code or 'unknown'}): {error_message}")
        self.error_code = error_code
        self.error_message = error_message


class NoSandboxError(IvySandboxClientError):
    """Waiting on a chat whose status is ``none``: never launched, or stopped meanwhile."""

    def __init__(self, chat_id: str) -> None:
        super().__init__(f"chat {chat_id} has no sandbox (launch it first)")
        self.chat_id = chat_id


class TimeoutError(IvySandboxClientError, builtins.TimeoutError):
    """Waiting took longer than the ``timeout`` asked for."""

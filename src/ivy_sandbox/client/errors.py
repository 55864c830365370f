"""Typed errors of the SDK, one per documented failure of the API.

::

    IvySandboxClientError
    ├── APIStatusError            any non-2xx answer (status_code, code, detail)
    │   ├── AuthenticationError   401
    │   ├── PermissionDeniedError 403
    │   ├── ConflictError         409
    │   └── RateLimitError        429 (retry_after seconds)
    ├── SandboxFailedError        the sandbox ended `failed` (error_code, error_message)
    └── TimeoutError              waiting took longer than asked (also a builtin TimeoutError)
"""

from __future__ import annotations

import builtins


class IvySandboxClientError(Exception):
    pass


class APIStatusError(IvySandboxClientError):
    def __init__(self, status_code: int, code: str, detail: str) -> None:
        super().__init__(f"{status_code} {code}: {detail}")
        self.status_code = status_code
        self.code = code
        self.detail = detail


class AuthenticationError(APIStatusError):
    pass


class PermissionDeniedError(APIStatusError):
    pass


class ConflictError(APIStatusError):
    pass


class RateLimitError(APIStatusError):
    def __init__(self, status_code: int, code: str, detail: str, retry_after: float) -> None:
        super().__init__(status_code, code, detail)
        self.retry_after = retry_after


class SandboxFailedError(IvySandboxClientError):
    def __init__(self, error_code: str | None, error_message: str) -> None:
        super().__init__(f"sandbox failed ({error_code or 'unknown'}): {error_message}")
        self.error_code = error_code
        self.error_message = error_message


class TimeoutError(IvySandboxClientError, builtins.TimeoutError):
    pass

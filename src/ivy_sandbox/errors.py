"""The one exception tree of ivy-sandbox.

Every error the service raises on purpose is one of these. Each carries three things that are
kept apart on purpose:

* ``code`` — a stable, machine-readable identifier (part of the API; never reworded),
* ``detail`` — the sentence a user sees in the response body (never contains a secret),
* ``log_message`` — what the operator sees in the log (may name *why* a credential was
  rejected, but never the credential itself).

The tree::

    IvySandboxError
    ├── ConfigurationError            bad setting; stops start-up (not an HTTP error)
    └── ApiError                      mapped to HTTP in one place: ivy_sandbox.api.problems
        ├── AuthenticationFailed      401  unauthenticated   (one body for every cause)
        ├── PermissionDenied          403  forbidden         (any chat you may not see)
        │   └── SessionRequired       403  session_required  (an API key managing keys)
        ├── NotFound                  404  not_found         (admin objects; never sandboxes)
        ├── Conflict                  409  conflict
        ├── InvalidRequest            422  invalid_request   (bad fields; never on status)
        ├── RateLimited               429  rate_limited      (+ Retry-After and RateLimit headers)
        └── ServiceUnavailable        503  unavailable       (database down; + Retry-After)
"""

from __future__ import annotations

from dataclasses import dataclass


class IvySandboxError(Exception):
    """Root of every error ivy-sandbox raises on purpose."""


class ConfigurationError(IvySandboxError):
    """A setting is missing or invalid; the message names the variable."""


class ApiError(IvySandboxError):
    """An error with a fixed HTTP status, a stable code and a user-safe detail."""

    status_code: int = 500
    code: str = "internal_error"
    title: str = "Internal Server Error"
    default_detail: str = "The server could not complete the request."

    def __init__(self, log_message: str = "", *, detail: str | None = None) -> None:
        super().__init__(log_message or self.code)
        self.log_message = log_message or self.code
        self.detail = detail or self.default_detail


class AuthenticationFailed(ApiError):
    """No usable credential. ``credential_sent`` decides the ``WWW-Authenticate`` error."""

    status_code = 401
    code = "unauthenticated"
    title = "Unauthorized"
    default_detail = "Authentication required: send a valid API key or session token."

    def __init__(self, log_message: str = "", *, credential_sent: bool = True) -> None:
        super().__init__(log_message)
        self.credential_sent = credential_sent


class PermissionDenied(ApiError):
    status_code = 403
    code = "forbidden"
    title = "Forbidden"
    default_detail = "You do not own this chat, or your key's project scope excludes it."


class SessionRequired(PermissionDenied):
    """An API key tried what only a Clerk session may do: a key can never mint, list or
    revoke keys."""

    code = "session_required"
    default_detail = (
        "API keys can be created, listed and revoked only with a Clerk session, "
        "not with an API key."
    )


class NotFound(ApiError):
    status_code = 404
    code = "not_found"
    title = "Not Found"
    default_detail = "No such object."


class Conflict(ApiError):
    status_code = 409
    code = "conflict"
    title = "Conflict"
    default_detail = "The request conflicts with the current state."


class InvalidRequest(ApiError):
    status_code = 422
    code = "invalid_request"
    title = "Unprocessable Content"
    default_detail = "The request is invalid."


@dataclass(frozen=True)
class RateLimitState:
    """What a client needs to back off: the policy that tripped and when it resets."""

    policy_name: str
    limit: int
    window_seconds: int
    remaining: int
    reset_seconds: int


class RateLimited(ApiError):
    status_code = 429
    code = "rate_limited"
    title = "Too Many Requests"
    default_detail = "Rate limit exceeded; retry after the number of seconds in Retry-After."

    def __init__(self, state: RateLimitState, log_message: str = "") -> None:
        super().__init__(log_message or f"rate limit {state.policy_name} exceeded")
        self.state = state


class ServiceUnavailable(ApiError):
    status_code = 503
    code = "unavailable"
    title = "Service Unavailable"
    default_detail = "The service is temporarily unavailable; retry shortly."
    retry_after_seconds = 5

"""Who is calling: the result of authentication, used for authorization and rate limiting."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class CredentialKind(StrEnum):
    API_KEY = "api_key"
    SESSION = "session"


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated user, possibly narrowed to one project by an API key's scope."""

    user_id: str
    kind: CredentialKind
    credential_id: str  # the key's kid or the Clerk session id (safe to log)
    project_id: str | None = None  # None: every chat the user owns

    @property
    def rate_limit_key(self) -> str:
        # Limits are per user, so minting more keys does not buy more requests.
        return self.user_id

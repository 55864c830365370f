"""The Python SDK for the ivy-sandbox API (httpx; the transport is injectable).

from ivy_sandbox.client import Client

with Client() as ivy:                      # IVY_API_URL / IVY_API_KEY from the environment
    ivy.sandbox.launch(chat_id)
    ivy.sandbox.wait_until_ready(chat_id, timeout=120)
    print(ivy.sandbox.exec(chat_id, ["ls", "/workspace"])["stdout"])
"""

from ivy_sandbox.client.errors import (
    APIStatusError,
    AuthenticationError,
    ConflictError,
    IvySandboxClientError,
    PermissionDeniedError,
    RateLimitError,
    SandboxFailedError,
    TimeoutError,
)
from ivy_sandbox.client.sync import Client

__all__ = [
    "APIStatusError",
    "AuthenticationError",
    "Client",
    "ConflictError",
    "IvySandboxClientError",
    "PermissionDeniedError",
    "RateLimitError",
    "SandboxFailedError",
    "TimeoutError",
]

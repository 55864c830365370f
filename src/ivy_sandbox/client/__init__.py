"""The Python SDK for the ivy-sandbox API (httpx; the transport is injectable).

::

    from ivy_sandbox.client import Client

    with Client() as ivy:  # IVY_API_URL / IVY_API_KEY from the environment
        ivy.sandbox.launch(chat_id)
        ivy.sandbox.wait_until_ready(chat_id, timeout=120, on_progress=print)
        print(ivy.sandbox.exec(chat_id, ["ls", "/workspace"])["stdout"])

:class:`AsyncClient` has the same methods, awaitable (``events`` is an async iterator).
Waiting uses Server-Sent Events, else long-poll, else polling once a second; see
``ivy_sandbox.client._protocol`` for the exact rules.
"""

from ivy_sandbox.client.aio import AsyncClient
from ivy_sandbox.client.errors import (
    APIConnectionError,
    APIStatusError,
    AuthenticationError,
    ConflictError,
    IvySandboxClientError,
    NoSandboxError,
    PermissionDeniedError,
    RateLimitError,
    SandboxFailedError,
    TimeoutError,
)
from ivy_sandbox.client.sync import Client
from ivy_sandbox.client.types import ExecResult, SandboxDetail, StatusBody

__all__ = [
    "APIConnectionError",
    "APIStatusError",
    "AsyncClient",
    "AuthenticationError",
    "Client",
    "ConflictError",
    "ExecResult",
    "IvySandboxClientError",
    "NoSandboxError",
    "PermissionDeniedError",
    "RateLimitError",
    "SandboxDetail",
    "SandboxFailedError",
    "StatusBody",
    "TimeoutError",
]

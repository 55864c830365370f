"""The app factory: settings in, a FastAPI app out. Nothing is built at import time."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

import ivy_sandbox
from ivy_sandbox.api import schemas as api_schemas
from ivy_sandbox.api.fast_status import FastStatus
from ivy_sandbox.api.middleware import BodyLimitMiddleware, SecurityHeadersMiddleware
from ivy_sandbox.api.observability import ObservabilityMiddleware
from ivy_sandbox.api.problems import install_error_handlers
from ivy_sandbox.api.routes import accounts, health, sandboxes
from ivy_sandbox.api.schemas import Problem
from ivy_sandbox.bootstrap import Services, build_services
from ivy_sandbox.config import Settings

API_PREFIX = "/v1"
# The seed's own examples call https://ivybiosciences.com/api/v1/…; serve that form too so a
# client written against them works by changing only the host. Only /v1 is documented.
ALIAS_PREFIX = "/api/v1"

SECURITY_SCHEMES: dict[str, Any] = {
    "bearerAuth": {
        "type": "http",
        "scheme": "bearer",
        "description": "An `ivy_` API key or a Clerk session JWT.",
    },
    "apiKeyHeader": {"type": "apiKey", "in": "header", "name": "X-Ivy-Api-Key"},
    "sessionCookie": {
        "type": "apiKey",
        "in": "cookie",
        "name": "__session",
        "description": "The Clerk session cookie (browser sessions).",
    },
}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, plus our auth schemes, minus the 422s our routes never send."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(
        title="ivy-sandbox",
        version=ivy_sandbox.__version__,
        description="The Ivy sandbox API: one isolated sandbox per chat.",
        routes=app.routes,
    )
    schema.setdefault("components", {})["securitySchemes"] = SECURITY_SCHEMES
    for path, path_item in schema.get("paths", {}).items():
        for operation in path_item.values():
            # The API needs a credential; the operator endpoints (/healthz, …) do not.
            needs_auth = path.startswith(API_PREFIX + "/")
            operation["security"] = [{name: []} for name in SECURITY_SCHEMES] if needs_auth else []
            responses = operation.get("responses", {})
            if responses.get("422", {}).get("description") == "Validation Error":
                responses.pop("422")  # FastAPI's generic one; documented 422s stay
    schemas = schema["components"].setdefault("schemas", {})
    schemas["Problem"] = Problem.model_json_schema()
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    _restore_model_examples(schemas)
    app.openapi_schema = schema
    return schema


def _restore_model_examples(components: dict[str, Any]) -> None:
    """FastAPI drops ``null`` values from examples while it builds the document, so an
    example with a required nullable field (``nextCursor: null``) would no longer validate
    against its own schema: put each model's examples back as the model declares them."""
    for name, model in vars(api_schemas).items():
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            continue
        if name in components and "examples" in components[name]:
            components[name]["examples"] = model.model_json_schema()["examples"]


def _mounted_routers() -> list[tuple[str, APIRouter]]:
    return [
        (prefix, router)
        for router in (sandboxes.router, accounts.router)
        for prefix in (API_PREFIX, ALIAS_PREFIX)
    ] + [("", health.router)]


MOUNTED_ROUTERS = _mounted_routers()


def allowed_methods_of(mounted: list[tuple[str, APIRouter]]) -> Callable[[str], list[str]]:
    """path → every method some route serves it with (for ``Allow`` on a 405)."""

    def allowed(path: str) -> list[str]:
        # Every route whose template matches, keeping the most specific templates only:
        # /sandbox/{chatId}/status also matches /sandbox/{chatId} (any chatId text), but the
        # documented resource is the one with the longer literal part.
        matches: list[tuple[int, set[str]]] = []
        for prefix, router in mounted:
            if not path.startswith(prefix):
                continue
            rest = path[len(prefix) :]
            for route in router.routes:
                if isinstance(route, APIRoute) and route.path_regex.match(rest):
                    literal = len(re.sub(r"\{[^}]*\}", "", route.path_format))
                    matches.append((literal, set(route.methods or ())))
        if not matches:
            return []
        best = max(literal for literal, _ in matches)
        # Only what is served: FastAPI's routes do not answer HEAD for GET, and a HEAD of
        # the event stream could not end, so HEAD is not offered.
        return sorted(set().union(*(m for literal, m in matches if literal == best)))

    return allowed


class IvyApp(FastAPI):
    """FastAPI, with the plain status poll answered in front of its stack (see fast_status)."""

    fast_status: FastStatus | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        fast = self.fast_status
        if (
            fast is not None
            and scope["type"] == "http"
            and scope["method"] == "GET"
            and await fast.answer(scope, send, self.state.services)
        ):
            return
        await super().__call__(scope, receive, send)


def create_app(settings: Settings, services: Services | None = None) -> FastAPI:
    """Build the app. ``services`` lets tests inject pre-built collaborators."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = services is None
        if services is None:
            built = await build_services(settings, with_worker=settings.run_worker)
            await built.start()
            app.state.services = built
        try:
            yield
        finally:
            if owned:
                await app.state.services.aclose()

    app = IvyApp(
        title="ivy-sandbox",
        version=ivy_sandbox.__version__,
        lifespan=lifespan,
        docs_url="/docs",
        redoc_url=None,
    )
    if services is not None:
        app.state.services = services
    app.include_router(sandboxes.router, prefix=API_PREFIX)
    app.include_router(sandboxes.router, prefix=ALIAS_PREFIX, include_in_schema=False)
    app.include_router(accounts.router, prefix=API_PREFIX)
    app.include_router(accounts.router, prefix=ALIAS_PREFIX, include_in_schema=False)
    app.include_router(health.router)
    install_error_handlers(app, allowed_methods_of(MOUNTED_ROUTERS))
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.max_request_bytes,
        max_header_bytes=settings.max_header_bytes,
    )
    app.add_middleware(SecurityHeadersMiddleware)
    app.add_middleware(ObservabilityMiddleware)  # outermost: sees every answer
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    app.fast_status = FastStatus(settings.max_header_bytes)
    return app

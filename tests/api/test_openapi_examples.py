"""Every operation in ``/openapi.json`` shows what it answers and what it takes, by example.

The README promises that the document covers every endpoint with examples: an integrator
reads them before any prose, and a client generator copies them into its docs. So every
success response with a body has at least one example, every request body has one, and every
example is valid against the schema it illustrates (a wrong example is worse than none).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema_rs
import pytest

Document = dict[str, Any]
Operation = tuple[str, str, dict[str, Any]]  # path, method, operation object

HTTP_METHODS = frozenset({"get", "put", "post", "delete", "patch", "head", "options", "trace"})
SANDBOX_OPERATIONS = {
    ("/v1/sandbox/{chatId}/status", "get"),
    ("/v1/sandbox/{chatId}/events", "get"),
    ("/v1/sandbox/{chatId}/exec", "post"),
    ("/v1/sandbox/{chatId}/keepalive", "post"),
    ("/v1/sandbox/{chatId}", "post"),
    ("/v1/sandbox/{chatId}", "delete"),
    ("/v1/sandbox/{chatId}", "get"),
    ("/metrics", "get"),
}


@pytest.fixture
async def document(client: httpx.AsyncClient) -> Document:
    response = await client.get("/openapi.json")
    assert response.status_code == 200
    parsed: Document = response.json()
    return parsed


def operations(document: Document) -> Iterator[Operation]:
    for path, item in document["paths"].items():
        for method, operation in item.items():
            if method in HTTP_METHODS:
                yield path, method, operation


def success_responses(operation: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {code: r for code, r in operation["responses"].items() if code.startswith("2")}


def illustrated(document: Document, schema: dict[str, Any]) -> dict[str, Any]:
    """The schema an example illustrates: ``$ref`` followed, and an optional body
    (``anyOf: [$ref, null]``) taken as the body it is when present."""
    options = schema.get("anyOf", [])
    if len(options) == 2 and {"type": "null"} in options:
        schema = next(option for option in options if option != {"type": "null"})
    if "$ref" in schema:
        resolved: dict[str, Any] = document["components"]["schemas"][
            schema["$ref"].rsplit("/", 1)[1]
        ]
        return resolved
    return schema


def examples(document: Document, media: dict[str, Any]) -> list[Any]:
    """Every example one media type shows: its own ``example``/``examples`` and its schema's."""
    found: list[Any] = []
    if "example" in media:
        found.append(media["example"])
    found.extend(example["value"] for example in media.get("examples", {}).values())
    found.extend(illustrated(document, media.get("schema", {})).get("examples", []))
    return found


def media_types(operation: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, media type object) for the request body and every documented response."""
    for name, media in operation.get("requestBody", {}).get("content", {}).items():
        yield f"request body {name}", media
    for code, response in operation["responses"].items():
        for name, media in response.get("content", {}).items():
            yield f"{code} {name}", media


def invalid_examples(document: Document) -> list[Any]:
    """(where, example, errors) for every example that does not validate. FastAPI drops
    nulls from examples while it builds the document; ``app._restore_model_examples`` puts
    them back (a page's ``nextCursor: null``, a live key's ``revokedAt: null``)."""
    invalid = []
    for path, method, operation in operations(document):
        for where, media in media_types(operation):
            check = validator(document, media.get("schema", {}))
            for example in examples(document, media):
                errors = [error.message for error in check.iter_errors(example)]
                if errors:
                    invalid.append((f"{method.upper()} {path} {where}", example, errors))
    return invalid


def validator(document: Document, schema: dict[str, Any]) -> Any:
    """A JSON Schema 2020-12 validator (what OpenAPI 3.1 uses) that resolves the document's
    ``#/components/...`` references."""
    return jsonschema_rs.Draft202012Validator({**schema, "components": document["components"]})


def test_the_document_lists_every_sandbox_operation_and_metrics(document: Document) -> None:
    listed = {(path, method) for path, method, _ in operations(document)}
    assert listed >= SANDBOX_OPERATIONS


def test_every_success_response_with_a_body_has_an_example(document: Document) -> None:
    missing = []
    for path, method, operation in operations(document):
        for code, response in success_responses(operation).items():
            if "content" not in response:
                assert code == "204", (path, method, code)  # only "no content" has none
                continue
            for name, media in response["content"].items():
                if not examples(document, media):
                    missing.append(f"{method.upper()} {path} {code} {name}")
    assert not missing, missing


def test_every_request_body_has_an_example(document: Document) -> None:
    missing = []
    for path, method, operation in operations(document):
        for name, media in operation.get("requestBody", {}).get("content", {}).items():
            if not examples(document, media):
                missing.append(f"{method.upper()} {path} {name}")
    assert not missing, missing


def test_every_example_is_valid_against_the_schema_it_illustrates(document: Document) -> None:
    assert not invalid_examples(document)


def test_the_status_examples_show_every_state_a_client_must_handle(document: Document) -> None:
    media = document["paths"]["/v1/sandbox/{chatId}/status"]["get"]["responses"]["200"]
    shown = {
        example["status"] for example in examples(document, media["content"]["application/json"])
    }
    assert shown == {"none", "provisioning", "active", "failed"}


def test_the_event_stream_example_carries_valid_status_bodies(document: Document) -> None:
    operation = document["paths"]["/v1/sandbox/{chatId}/events"]["get"]
    (stream,) = examples(document, operation["responses"]["200"]["content"]["text/event-stream"])
    bodies = [
        json.loads(line.removeprefix("data: "))
        for line in stream.splitlines()
        if line.startswith("data: ")
    ]
    check = validator(document, {"$ref": "#/components/schemas/StatusBody"})
    assert bodies, stream
    assert all(check.is_valid(body) for body in bodies), bodies
    assert bodies[-1]["status"] == "active"  # a stream ends at a terminal state
    assert ": keep-alive" in stream.splitlines()


def test_the_long_poll_response_headers_are_documented(document: Document) -> None:
    headers = document["paths"]["/v1/sandbox/{chatId}/status"]["get"]["responses"]["200"]
    assert {"ETag", "Preference-Applied"} <= set(headers["headers"])

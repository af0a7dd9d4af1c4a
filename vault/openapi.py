"""The admin API's OpenAPI 3.1 document, generated from OPERATIONS and the pydantic models."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, TypeAdapter
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from vault.admin import Access, Operation
from vault.models import ErrorResponse, IdempotencyKey, IssuedKey, KeyId

_REF = "#/components/schemas/{model}"
_PATH_PARAMETERS: dict[str, dict[str, Any]] = {
    "key_id": TypeAdapter(KeyId).json_schema(),
    "idempotency_key": TypeAdapter(IdempotencyKey).json_schema(),
}
_SECURITY: dict[Access, list[dict[str, list[str]]]] = {
    "public": [],
    "admin": [{"adminToken": []}],
    "worker": [{"adminToken": []}, {"workerToken": []}],
}
_ERROR_DESCRIPTIONS = {
    400: "Malformed request (body not JSON)",
    401: "Missing or wrong token",
    403: "The worker token may not do this: an admin-only operation, an admin's key, or a key"
    " past the worker budget or its window",
    404: "No such key or reservation",
    409: "Conflicts with the reservation's state",
    408: "The body did not arrive within VAULT_BODY_TIMEOUT_SECONDS of the headers",
    413: "The body is larger than the vault reads (1 MiB)",
    422: "A field failed validation; `error.fields` says which and why",
    500: "The vault failed, e.g. its database did not answer",
    503: "Not ready",
}


def openapi_document(
    operations: Sequence[Operation], version: str, max_cap_cents: int
) -> dict[str, Any]:
    models: list[tuple[type[BaseModel], JsonSchemaMode]] = [(ErrorResponse, "serialization")]
    for op in operations:
        models.append((op.response, "serialization"))
        if op.body is not None:
            models.append((op.body, "validation"))
    refs, definitions = models_json_schema(list(dict.fromkeys(models)), ref_template=_REF)
    error_content = {"application/json": {"schema": refs[(ErrorResponse, "serialization")]}}

    # Where a key's id comes from, for tools that chain calls (schemathesis's stateful runs).
    key_links = {
        op.operation_id: {
            "operationId": op.operation_id,
            "parameters": {"key_id": "$response.body#/id"},
        }
        for op in operations
        if "{key_id}" in op.path
    }
    paths: dict[str, dict[str, Any]] = {}
    for op in operations:
        parameters = [
            {"name": name, "in": "path", "required": True, "schema": _PATH_PARAMETERS[name]}
            for name in re.findall(r"\{(\w+)\}", op.path)
        ]
        if op.query is not None:
            parameters += _query_parameters(op.query)
        responses: dict[str, Any] = {
            str(op.status): {
                "description": op.summary,
                "content": {"application/json": {"schema": refs[(op.response, "serialization")]}},
            }
        }
        if op.response is IssuedKey:
            responses[str(op.status)]["links"] = key_links
        # aiohttp answers 413 past its body limit; any handler answers 500 when Postgres fails.
        errors = {500, *op.other_errors}
        if op.access != "public":
            errors.add(401)
        if op.access == "admin":
            errors.add(403)
        if "{key_id}" in op.path:
            errors.add(404)
        if op.body is not None:
            errors |= {400, 408, 413, 422}
        if op.query is not None:
            errors.add(422)
        for status in sorted(errors):
            responses[str(status)] = {
                "description": _ERROR_DESCRIPTIONS[status],
                "content": error_content,
            }
        operation: dict[str, Any] = {
            "operationId": op.operation_id,
            "summary": op.summary,
            "security": _SECURITY[op.access],
            "responses": responses,
        }
        if parameters:
            operation["parameters"] = parameters
        if op.body is not None:
            operation["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": refs[(op.body, "validation")]}},
            }
        paths.setdefault(op.path, {})[op.method.lower()] = operation

    schemas = definitions.get("$defs", {})
    # The ceiling is configuration, so the document this vault serves states its own.
    caps = schemas["IssueKeyRequest"]["properties"]
    caps["cap_cents"]["maximum"] = max_cap_cents
    caps["daily_cap_cents"]["anyOf"][0]["maximum"] = max_cap_cents
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Vault proxy admin API",
            "version": version,
            "description": "Spend-capped Stripe keys. Stripe itself is proxied at /stripe/v1/...",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "adminToken": {"type": "http", "scheme": "bearer"},
                "workerToken": {"type": "http", "scheme": "bearer"},
            },
        },
    }


def _query_parameters(model: type[BaseModel]) -> list[dict[str, Any]]:
    schema = model.model_json_schema(ref_template=_REF)
    required = set(schema.get("required", ()))
    return [
        {"name": name, "in": "query", "required": name in required, "schema": _not_null(prop)}
        for name, prop in schema["properties"].items()
    ]


def _not_null(schema: dict[str, Any]) -> dict[str, Any]:
    """An optional query parameter is omitted, never sent as null: drop the null branch."""
    variants = [s for s in schema.get("anyOf", ()) if s.get("type") != "null"]
    if len(variants) != 1:
        return schema
    rest = {k: v for k, v in schema.items() if k not in ("anyOf", "default")}
    return {**rest, **variants[0]}

"""OpenAPI for guarded operations: the Idempotency-Key header, the problem responses, the replay
header. FastAPI gets it from `idem_middleware.fastapi.document(app)`; a Starlette app passes its
SchemaGenerator output through `document_openapi(schema, app)`."""

from __future__ import annotations

import copy
from typing import Any

from .errors import ProblemKind
from .ops import guarded_operations
from .policy import Policy
from .responses import DEFAULT_PROBLEM_BASE, problem_title

PROBLEM_SCHEMA = "IdempotencyProblem"
_PROBLEM_REF = {"$ref": f"#/components/schemas/{PROBLEM_SCHEMA}"}

_PROBLEM_DETAILS = {
    "title": "ProblemDetails",
    "description": "An RFC 9457 problem. `type` is stable per kind of refusal.",
    "type": "object",
    "properties": {
        "type": {"type": "string", "format": "uri-reference"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
        "instance": {"type": "string"},
    },
    "required": ["type", "title", "status"],
}

# The refusals every guarded operation can answer, by status.
_RESPONSES: dict[str, tuple[ProblemKind, ...]] = {
    "400": (ProblemKind.MISSING_KEY, ProblemKind.INVALID_KEY, ProblemKind.BODY_INVALID),
    "401": (ProblemKind.UNAUTHENTICATED,),
    "409": (ProblemKind.IN_FLIGHT, ProblemKind.OUTCOME_UNKNOWN),
    "413": (ProblemKind.BODY_TOO_LARGE,),
    "422": (ProblemKind.KEY_REUSED,),
    "503": (ProblemKind.STORE_UNAVAILABLE,),
}


def _retention(seconds: float) -> str:
    if seconds % 86400 == 0:
        days = int(seconds // 86400)
        return f"{days} day{'s' if days != 1 else ''}"
    if seconds % 3600 == 0:
        return f"{int(seconds // 3600)} hours"
    return f"{seconds:g} seconds"


def header_parameter(policy: Policy) -> dict[str, Any]:
    required = policy.key_required
    return {
        "name": "Idempotency-Key",
        "in": "header",
        "required": required,
        "description": (
            "Makes retries of this request safe. A string of 1-255 printable ASCII characters, "
            'sent as a structured-field string (`"8e03f1..."`) or a bare token; use a new '
            "random value (a UUID) per intent and the same value for each retry. A repeated "
            "request with the same key gets the original response, marked "
            "`Idempotent-Replayed: true`; the same key with a different request is a 422. "
            f"Outcomes are kept for {_retention(policy.retention_seconds)}."
            + ("" if required else " Optional: without it the request is not deduplicated.")
        ),
        "schema": {"type": "string", "minLength": 1, "maxLength": 257},
    }


def _problem_response(kinds: tuple[ProblemKind, ...], base: str) -> dict[str, Any]:
    described = "; ".join(f"`{base}{k.value}`: {problem_title(k)}" for k in kinds)
    return {
        "description": described,
        "content": {"application/problem+json": {"schema": copy.deepcopy(_PROBLEM_REF)}},
    }


def document_openapi(
    schema: dict[str, Any], app: Any, *, problem_base: str = DEFAULT_PROBLEM_BASE
) -> dict[str, Any]:
    """Add the idempotency documentation to every guarded operation of `app` in `schema`."""
    operations = guarded_operations(app)
    if not operations:
        return schema
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components[PROBLEM_SCHEMA] = copy.deepcopy(_PROBLEM_DETAILS)
    paths = schema.get("paths", {})
    for item in paths.values():
        for operation in item.values():
            if isinstance(operation, dict) and "responses" in operation:
                # YAML docstrings (Starlette's SchemaGenerator) give integer status keys.
                operation["responses"] = {str(k): v for k, v in operation["responses"].items()}
    for op in operations:
        operation = paths.get(op.path_format, {}).get(op.method.lower())
        if operation is None:
            continue
        parameters = operation.setdefault("parameters", [])
        parameters[:] = [
            p
            for p in parameters
            if not (p.get("in") == "header" and p.get("name", "").lower() == "idempotency-key")
        ]
        parameters.append(header_parameter(op.policy))
        responses = operation.setdefault("responses", {})
        for status, response in responses.items():
            if status.startswith(("2", "3")):
                response.setdefault("headers", {})["Idempotent-Replayed"] = {
                    "description": "`true` when this is the stored response of an earlier "
                    "request with the same key",
                    "schema": {"type": "string", "enum": ["true"]},
                }
        extra = dict(_RESPONSES)
        if op.policy.accept_while_in_flight:
            responses["202"] = {
                "description": "The original request is still running; its status is at "
                "`Location`.",
                "headers": {"Location": {"schema": {"type": "string"}}},
            }
        for status, kinds in extra.items():
            problem = _problem_response(kinds, problem_base)
            if status in responses:
                # Keep what the app documents (FastAPI's validation 422) and add the problem.
                existing = responses[status]
                existing.setdefault("content", {}).update(problem["content"])
                existing["description"] = (
                    f"{existing.get('description', '')} / {problem['description']}"
                )
            else:
                responses[status] = problem
            if status == "409":
                responses[status]["headers"] = {
                    "Retry-After": {
                        "description": "Seconds to wait before retrying a request in flight",
                        "schema": {"type": "integer"},
                    }
                }
    return schema

"""OpenAPI for guarded operations: the Idempotency-Key header, the problem responses, the replay
header. FastAPI gets it from `idem_middleware.fastapi.document(app)`; a Starlette app passes its
SchemaGenerator output through `document_openapi(schema, app)`."""

from __future__ import annotations

import copy
from typing import Any

from .errors import ProblemKind
from .keys import MAX_KEY_LENGTH
from .keysource import KeyFromHeader, as_key_source
from .middleware import IdempotencyMiddleware
from .ops import find_middleware, guarded_operations
from .outcomes import RELEASE_STATUSES
from .policy import Policy
from .responses import DEFAULT_PROBLEM_BASE, problem_status, problem_title

PROBLEM_SCHEMA = "IdempotencyProblem"
_PROBLEM_REF = {"$ref": f"#/components/schemas/{PROBLEM_SCHEMA}"}

_PROBLEM_TYPE = "application/problem+json"
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

# The refusals are every ProblemKind (a new kind is documented unless it is listed here), with
# its status: only the library's own routes answer these.
_ROUTES_ONLY = frozenset(
    {ProblemKind.RECORD_NOT_FOUND, ProblemKind.TOKEN_CONFLICT, ProblemKind.METHOD_NOT_ALLOWED}
)
# Sent with Retry-After.
_RETRY_AFTER = frozenset(
    {
        ProblemKind.IN_FLIGHT,
        ProblemKind.TENANT_BUSY,
        ProblemKind.STORE_UNAVAILABLE,
        ProblemKind.CANCELLED,
    }
)


def _problems(policy: Policy, mw: IdempotencyMiddleware | None) -> dict[str, list[ProblemKind]]:
    """The refusals an operation under `policy` can answer, by status."""
    applies = {
        ProblemKind.TOKEN_INVALID: policy.require_token,
        ProblemKind.UNAUTHENTICATED: not policy.allow_anonymous,
        ProblemKind.TENANT_BUSY: mw is not None and mw.tenant_slots.limit is not None,
    }
    by_status: dict[str, list[ProblemKind]] = {}
    for kind in ProblemKind:
        if kind not in _ROUTES_ONLY and applies.get(kind, True):
            by_status.setdefault(str(problem_status(kind)), []).append(kind)
    return dict(sorted(by_status.items()))


def _retention(seconds: float) -> str:
    if seconds % 86400 == 0:
        days = int(seconds // 86400)
        return f"{days} day{'s' if days != 1 else ''}"
    if seconds % 3600 == 0:
        return f"{int(seconds // 3600)} hours"
    return f"{seconds:g} seconds"


# The header's value as keys.parse_key_value accepts it: an sf-string of 1-255 characters (each
# printable ASCII, `"` and `\\` escaped, so up to 2 + 2 * 255 long), or a bare token.
_KEY_PATTERN = (
    rf'^(?:"(?:[ !#-\[\]-~]|\\["\\]){{1,{MAX_KEY_LENGTH}}}"|[!#-~]{{1,{MAX_KEY_LENGTH}}})$'
)
_REPLAYED_HEADER = {
    "description": "`true`: the stored response of an earlier request with the same key",
    "schema": {"type": "string", "enum": ["true"]},
}
_RETRY_AFTER_HEADER = {
    "description": "Seconds to wait before retrying",
    "schema": {"type": "integer"},
}


def _replayable(status: str) -> bool:
    """A documented status a replay can answer: success, redirect, and the final 4xx refusals
    (402, 410 ...) that are stored; "nothing happened" statuses and 5xx are never stored."""
    if status in ("2XX", "3XX", "4XX"):
        return True
    if not (len(status) == 3 and status.isdigit()):
        return False  # "default", "5XX"
    return 200 <= int(status) < 500 and int(status) not in RELEASE_STATUSES


def header_parameter(policy: Policy, name: str = "Idempotency-Key") -> dict[str, Any]:
    required = policy.key_required
    return {
        "name": name,
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
        "schema": {
            "type": "string",
            "minLength": 1,
            "maxLength": 2 + 2 * MAX_KEY_LENGTH,
            "pattern": _KEY_PATTERN,
        },
    }


def _document_key(operation: dict[str, Any], policy: Policy) -> None:
    """The key's header parameter (Idempotency-Key, or the policy's own header); for a key in
    the body or computed by a function, no header but a line in the description."""
    source = as_key_source(policy.key_source)  # a Policy has wrapped a function already
    name = source.name if isinstance(source, KeyFromHeader) else "Idempotency-Key"
    parameters = operation.setdefault("parameters", [])
    parameters[:] = [
        p
        for p in parameters
        if not (p.get("in") == "header" and p.get("name", "").lower() == name.lower())
    ]
    if source is None or isinstance(source, KeyFromHeader):
        parameters.append(header_parameter(policy, name))
        return
    line = (
        f"Idempotent: the key is taken from {source.describe()} (1-255 printable ASCII "
        "characters); a repeated request with the same key gets the original response, marked "
        "`Idempotent-Replayed: true`."
    )
    operation["description"] = "\n\n".join(filter(None, [operation.get("description"), line]))


# What responses.send_accepted sends.
_ACCEPTED = {
    "description": "The original request is still running; its status is at `Location`.",
    "headers": {
        "Location": {"schema": {"type": "string"}},
        "Retry-After": _RETRY_AFTER_HEADER,
        "Cache-Control": {"schema": {"type": "string", "enum": ["no-store"]}},
    },
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "properties": {
                    "status": {"type": "string", "enum": ["processing"]},
                    "location": {"type": "string"},
                },
                "required": ["status", "location"],
            }
        }
    },
}


def _problem_response(kinds: list[ProblemKind], base: str) -> dict[str, Any]:
    described = "; ".join(f"`{base}{k.value}`: {problem_title(k)}" for k in kinds)
    return {
        "description": described,
        "content": {_PROBLEM_TYPE: {"schema": copy.deepcopy(_PROBLEM_REF)}},
    }


def document_openapi(
    schema: dict[str, Any], app: Any, *, problem_base: str | None = None, mount: str = ""
) -> dict[str, Any]:
    """Add the idempotency documentation to every guarded operation of `app` in `schema`.
    `problem_base` defaults to the app's IdempotencyMiddleware's. `mount`: `schema` is that of
    an application mounted in `app` at this path (`/v1`), whose own paths omit it."""
    operations = [op for op in guarded_operations(app) if op.path_format.startswith(mount + "/")]
    if not operations:
        return schema
    mw = find_middleware(app)
    if problem_base is None:
        problem_base = DEFAULT_PROBLEM_BASE if mw is None else mw.problem_base
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components[PROBLEM_SCHEMA] = copy.deepcopy(_PROBLEM_DETAILS)
    paths = schema.get("paths", {})
    for item in paths.values():
        for operation in item.values():
            if isinstance(operation, dict) and "responses" in operation:
                # YAML docstrings (Starlette's SchemaGenerator) give integer status keys.
                operation["responses"] = {str(k): v for k, v in operation["responses"].items()}
    for op in operations:
        operation = paths.get(op.path_format[len(mount) :], {}).get(op.method.lower())
        if operation is None:
            continue
        _document_key(operation, op.policy)
        responses = operation.setdefault("responses", {})
        for status, response in responses.items():
            if _replayable(status):
                response.setdefault("headers", {})["Idempotent-Replayed"] = copy.deepcopy(
                    _REPLAYED_HEADER
                )
        if op.policy.accept_while_in_flight:
            responses["202"] = copy.deepcopy(_ACCEPTED)
        for status, kinds in _problems(op.policy, mw).items():
            problem = _problem_response(kinds, problem_base)
            if status in responses:
                # Keep what the app documents (FastAPI's validation 422, or a problem of the
                # app's own at this status: then either shape) and add the problem.
                existing = responses[status]
                content = existing.setdefault("content", {})
                own = content.get(_PROBLEM_TYPE, {}).get("schema")
                content.update(problem["content"])
                if own is not None and own != _PROBLEM_REF:
                    either = {"anyOf": [own, copy.deepcopy(_PROBLEM_REF)]}
                    content[_PROBLEM_TYPE] = {"schema": either}
                existing["description"] = (
                    f"{existing.get('description', '')} / {problem['description']}"
                )
            else:
                responses[status] = problem
            if ProblemKind.UNAUTHENTICATED in kinds and mw is not None and mw.tenants.challenge:
                responses[status].setdefault("headers", {})["WWW-Authenticate"] = {
                    "description": "The authentication challenge (RFC 9110)",
                    "schema": {"type": "string", "example": mw.tenants.challenge.decode()},
                }
            if _RETRY_AFTER.intersection(kinds):
                # (Added to the headers the app documents for this status, never in their place.)
                responses[status].setdefault("headers", {})["Retry-After"] = copy.deepcopy(
                    _RETRY_AFTER_HEADER
                )
    return schema

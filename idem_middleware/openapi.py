"""OpenAPI for guarded operations: the Idempotency-Key header, the problem responses, the replay
header. FastAPI gets it from `idem_middleware.fastapi.document(app)`; a Starlette app passes its
SchemaGenerator output through `document_openapi(schema, app)`."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote

from .errors import ProblemKind
from .keys import MAX_KEY_LENGTH
from .keysource import KeyFromHeader, as_key_source
from .library_routes import ROUTE_OPERATIONS_ATTRIBUTE, GuardedOperations
from .middleware import IdempotencyMiddleware
from .ops import GuardedOperation, find_middleware, guarded_operations
from .outcomes import RELEASE_STATUSES
from .policy import Policy
from .responses import DEFAULT_PROBLEM_BASE, problem_status, problem_title
from .routing import Found, listed_routes, walk

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
        # (only where the client's method or path names the operation: no route's contract)
        ProblemKind.OPERATION_INVALID: False,
    }
    by_status: dict[str, list[ProblemKind]] = {}
    for kind in ProblemKind:
        if kind not in _ROUTES_ONLY and applies.get(kind, True):
            by_status.setdefault(str(problem_status(kind)), []).append(kind)
    return dict(sorted(by_status.items()))


def _retention(seconds: float) -> str:
    """Exactly (`1234567 seconds`, never `1.23457e+06`), in days or hours when whole."""
    for unit, size in (("day", 86400), ("hour", 3600), ("second", 1)):
        if seconds % size == 0:
            count = int(seconds // size)
            return f"{count:,} {unit}{'s' if count != 1 else ''}"
    return f"{seconds!r} seconds"  # (a fraction: its shortest exact digits)


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


def _token_sentence(operation: str | None, token_path: str | None) -> str:
    """How a client gets a key for a `require_token` operation: anything it makes up itself is
    refused (400 token-invalid), a UUID included."""
    route = f"`POST {token_path}`" if token_path else "the server's token route"
    body = f'`{{"operation": "{operation}"}}`' if operation else "the operation"
    return (
        f"The key must be a one-time token issued by the server: get one from {route} with "
        f"{body} (and an optional `intent_id`: the same intent gets the same token); a value "
        "the client makes up (a UUID) is refused, 400 token-invalid."
    )


def header_parameter(
    policy: Policy,
    name: str = "Idempotency-Key",
    *,
    operation: str | None = None,
    token_path: str | None = None,
    required: bool | None = None,
) -> dict[str, Any]:
    """The key's header parameter. For `require_token`, `operation` (`POST /orders`) and the
    token route's `token_path` name the request that gets a token. `required` defaults to the
    policy's `key_required` (an app's own parameter may require the header where it does not)."""
    required = policy.key_required if required is None else required
    if policy.require_token:
        what = f"{_token_sentence(operation, token_path)} Send the same token with each retry."
    else:
        what = (
            "A string of 1-255 printable ASCII characters, sent as a structured-field string "
            '(`"8e03f1..."`) or a bare token; use a new random value (a UUID) per intent and the '
            "same value for each retry."
        )
    return {
        "name": name,
        "in": "header",
        "required": required,
        "description": (
            f"Makes retries of this request safe. {what} A repeated request with the same key "
            "gets the original response, marked `Idempotent-Replayed: true`; the same key with a "
            "different request is a 422. "
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


def _token_path(app: Any) -> str | None:
    """Where the app serves its token route (the first, as the router tries them), if it has
    one that can be seen."""
    for item in walk(listed_routes(app) or ()):
        if not isinstance(item, Found):
            continue
        operations = getattr(item.endpoint, ROUTE_OPERATIONS_ATTRIBUTE, None)
        if isinstance(operations, GuardedOperations) and operations.kind == "tokens":
            return item.path_format
    return None


def _resolved(schema: dict[str, Any], node: Any) -> dict[str, Any] | None:
    """The object `node` is, following its `$ref`s within `schema`; None for a reference to
    another document (or to nothing)."""
    seen: set[str] = set()
    while isinstance(node, dict) and "$ref" in node:
        ref = node["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#/") or ref in seen:
            return None
        seen.add(ref)
        node = schema
        for part in ref[2:].split("/"):
            # A URI fragment holding a JSON Pointer: percent-encoded, then `~1` and `~0`.
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def _document_key(
    schema: dict[str, Any], operation: dict[str, Any], op: GuardedOperation, token_path: str | None
) -> None:
    """The key's header parameter (Idempotency-Key, or the policy's own header); for a key in
    the body or computed by a function, no header but a line in the description."""
    policy = op.policy
    source = as_key_source(policy.key_source)  # a Policy has wrapped a function already
    if source is None or isinstance(source, KeyFromHeader):
        name = source.name if isinstance(source, KeyFromHeader) else "Idempotency-Key"
        parameters = operation.setdefault("parameters", [])
        # The app's own parameter for the header (a `$ref` to one too) is merged into the
        # middleware's, one parameter (two would be invalid).
        named = [_resolved(schema, p) or {} for p in parameters]
        own = [
            it
            for it in named
            if it.get("in") == "header" and str(it.get("name", "")).lower() == name.lower()
        ]
        parameters[:] = [p for p, it in zip(parameters, named, strict=True) if it not in own]
        required = policy.key_required or any(it.get("required") is True for it in own)
        added = header_parameter(
            policy, name, operation=op.name, token_path=token_path, required=required
        )
        parameters.append(_keeping(own[0], added) if own else added)
        return
    line = (
        f"Idempotent: the key is taken from {source.describe()} (1-255 printable ASCII "
        "characters); a repeated request with the same key gets the original response, marked "
        "`Idempotent-Replayed: true`."
    )
    if policy.require_token:
        line += " " + _token_sentence(op.name, token_path)
    if line not in (described := operation.get("description") or ""):  # (documented before)
        operation["description"] = "\n\n".join(filter(None, [described, line]))


def _keeping(own: dict[str, Any], added: dict[str, Any]) -> dict[str, Any]:
    """The key's parameter where the app documents one of its own (FastAPI's `Header(...,
    min_length=8)`, a UUID): the app's constraints stand beside the middleware's, since a request
    has to meet both (its own description and examples kept too)."""
    merged = {**own, **added}
    if (mine := own.get("description")) and added["description"] not in mine:
        merged["description"] = f"{mine}\n\n{added['description']}"
    elif mine:
        merged["description"] = mine  # it holds the middleware's already (documented before)
    ours = added["schema"]
    theirs = own.get("schema")
    if "content" in own:
        del merged["schema"]  # OpenAPI allows one of `schema` and `content`: the app's stands
    elif isinstance(theirs, dict) and ours in theirs.get("allOf", []):
        merged["schema"] = theirs  # (documented before)
    elif isinstance(theirs, dict) and any(
        ours.get(k) != v for k, v in theirs.items() if k not in ("title", "description")
    ):
        merged["schema"] = {"allOf": [theirs, ours]}
    return merged


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


def _inline(
    schema: dict[str, Any], responses: dict[str, Any], status: str
) -> dict[str, Any] | None:
    """The response at `status`, to add to: a `$ref` (`#/components/responses/...`) is replaced
    by a copy of what it names, since OpenAPI allows nothing beside a `$ref` (tools ignore it,
    validators refuse it) and the component may serve other operations. None when there is
    nothing to add to: no such response, or a reference that cannot be followed (another
    document's), left as the app wrote it."""
    response = responses.get(status)
    target = _resolved(schema, response)
    if target is not None and target is not response:
        target = copy.deepcopy(target)
        if isinstance(response, dict) and "description" in response:
            target["description"] = response["description"]  # (3.1: the reference's wins)
        responses[status] = target
    return target


def _either(own: Any, added: dict[str, Any]) -> Any:
    if own is None or own == added:
        return added
    if isinstance(own, dict) and added in own.get("anyOf", []):
        return own
    return {"anyOf": [own, added]}


def _add_header(response: dict[str, Any], name: str, header: dict[str, Any]) -> None:
    """Add a header the app does not document in any case (`retry-after`): its own stands."""
    headers = response.setdefault("headers", {})
    if name.lower() not in {str(h).lower() for h in headers}:
        headers[name] = copy.deepcopy(header)


def _merge(own: dict[str, Any], added: dict[str, Any]) -> None:
    """Document what the middleware answers at a status the app documents too: either body
    (per media type), the app's headers kept and the middleware's added, both descriptions
    (once each: the additions may be applied to a document that has them already)."""
    content = own.setdefault("content", {})
    for media, entry in added.get("content", {}).items():
        mine = content.get(media, {})
        content[media] = {**mine, "schema": _either(mine.get("schema"), entry["schema"])}
    for name, header in added.get("headers", {}).items():
        _add_header(own, name, header)
    described = own.get("description")
    if not described:
        own["description"] = added["description"]
    elif added["description"] not in described.split(" / "):
        own["description"] = f"{described} / {added['description']}"


def document_openapi(
    schema: dict[str, Any],
    app: Any,
    *,
    problem_base: str | None = None,
    operations: Sequence[tuple[GuardedOperation, str]] | None = None,
) -> dict[str, Any]:
    """Add the idempotency documentation to every guarded operation of `app` in `schema`;
    applied again to its own output, it changes nothing. `problem_base` defaults to the app's
    IdempotencyMiddleware's. `operations`: those `schema` lists, each with its path there
    (`idem_middleware.fastapi`'s, for a FastAPI app's own routes); by default every guarded
    operation of `app` at its path, as a SchemaGenerator lists them (every mount's routes)."""
    if operations is None:
        operations = [(op, op.path_format) for op in guarded_operations(app)]
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
    token_path = _token_path(app)
    for op, path in operations:
        operation = paths.get(path, {}).get(op.method.lower())
        if operation is None:
            continue
        _document_key(schema, operation, op, token_path)
        responses = operation.setdefault("responses", {})
        for status in list(responses):
            if responses[status] == _ACCEPTED:
                continue  # the in-flight 202 added before: never a replay
            if _replayable(status) and (response := _inline(schema, responses, status)) is not None:
                _add_header(response, "Idempotent-Replayed", _REPLAYED_HEADER)
        added = [
            (status, _problem_response(kinds, problem_base), kinds)
            for status, kinds in _problems(op.policy, mw).items()
        ]
        if op.policy.accept_while_in_flight:
            added.insert(0, ("202", copy.deepcopy(_ACCEPTED), []))
        for status, answer, kinds in added:
            if status not in responses:
                responses[status] = answer
            elif (own := _inline(schema, responses, status)) is not None:
                # Keep what the app documents (a job API's own 202, FastAPI's validation 422, a
                # problem of the app's own) and add what the middleware answers there.
                _merge(own, answer)
            else:
                continue  # another document's response: nothing can be added beside its $ref
            # (Added to the headers the app documents for this status, never in their place.)
            if ProblemKind.UNAUTHENTICATED in kinds and mw is not None and mw.tenants.challenge:
                challenge = {"type": "string", "example": mw.tenants.challenge.decode()}
                _add_header(
                    responses[status],
                    "WWW-Authenticate",
                    {"description": "The authentication challenge (RFC 9110)", "schema": challenge},
                )
            if _RETRY_AFTER.intersection(kinds):
                _add_header(responses[status], "Retry-After", _RETRY_AFTER_HEADER)
    return schema

"""The status resource a 202 points at: what became of a request, for its own tenant only."""

from __future__ import annotations

import inspect

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .errors import ProblemKind
from .middleware import TenantResolver, authenticated_user_tenant
from .responses import DEFAULT_PROBLEM_BASE, problem_status, problem_title
from .store.base import RecordKey, Store


def _problem(kind: ProblemKind, detail: str) -> Response:
    body = {
        "type": DEFAULT_PROBLEM_BASE + kind.value,
        "title": problem_title(kind),
        "status": problem_status(kind),
        "detail": detail,
    }
    return Response(orjson.dumps(body), problem_status(kind), media_type="application/problem+json")


def status_route(
    store: Store,
    *,
    path: str = "/idempotency/status",
    tenant_resolver: TenantResolver = authenticated_user_tenant,
) -> Route:
    """`GET path?operation=POST%20/payouts&key=abc`: the state of the caller's own request.

    The tenant comes from authentication, as for the guarded routes: another tenant's record
    with the same key is simply not found.
    """

    async def status(request: Request) -> Response:
        tenant = tenant_resolver(request.scope)
        if inspect.isawaitable(tenant):
            tenant = await tenant
        if not tenant:
            return _problem(ProblemKind.UNAUTHENTICATED, "This resource needs authentication.")
        operation = request.query_params.get("operation")
        key = request.query_params.get("key")
        if not operation or not key:
            return _problem(ProblemKind.INVALID_KEY, "Pass the operation and the key.")
        record_key = RecordKey(tenant, operation, key)
        record = await store.get(record_key)
        if record is None or record.expired:
            # A transactional claim is invisible until it commits; ask whether one is running.
            if record is None and await store.in_flight(record_key):
                body: dict[str, object] = {
                    "operation": operation,
                    "state": "pending",
                    "response_status": None,
                }
                return Response(orjson.dumps(body), 200, media_type="application/json")
            return _problem(ProblemKind.RECORD_NOT_FOUND, "No such request for this caller.")
        body = {
            "operation": operation,
            "state": record.state.value,
            "response_status": None if record.response is None else record.response.status,
        }
        return Response(orjson.dumps(body), 200, media_type="application/json")

    return Route(path, status, methods=["GET"], name="idempotency_status")

"""The status resource a 202 points at: what became of a request, for its own tenant only.

It reports from the caller's own committed record, read with one SELECT (nothing is written,
nothing is locked). A transactional-mode request that has not committed has no record anyone
else can see, but its claim holds the key's claim lock until it ends: the same SELECT reads
whether that lock is held (pg_locks; MemoryStore: its claimed keys), and such a request is
reported `pending` like a lease-mode claim, which commits its pending record at once. A running
request's answer carries `Retry-After`: when to ask again.
"""

from __future__ import annotations

import re

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .answers import request_digest
from .errors import ConfigurationError, ProblemKind, RequestRejected, StoreError, TextRefused
from .keys import check_key, parse_idempotency_key
from .library_routes import ROUTE_OPERATIONS_ATTRIBUTE, GuardedOperations, LibraryRoute
from .policy import LOOKED_UP_SHAPE, LeaseExpiry, Mode, Policy
from .responses import problem_response
from .store.base import Record, RecordKey, State, Store
from .tenant import (
    ROUTE_RESOLVER_ATTRIBUTE,
    ROUTE_TENANTS_ATTRIBUTE,
    TenantResolver,
    Tenants,
    authenticated_user_tenant,
    route_tenant,
)

_BAD_OPERATION = (
    "The operation is `METHOD /path-template` (under a Host route `METHOD host/path-template`),"
    " as the Location of a 202 gives it."
)

_NO_KEY = "Pass the operation, and the key in the query or in the Idempotency-Key header."
_TWO_KEYS = "The key in the query and the one in the Idempotency-Key header differ."
_REPEATED = "Pass the operation and the key once each."
# A URL lands in access logs (the server's, every proxy's): a token sent in one is refused, so
# that no client comes to rely on it; the refusal, logged or not, never repeats it.
_TOKEN_IN_URL = (
    "This operation's key is a one-time token: send it in the Idempotency-Key header, never in"
    " the URL (servers and proxies log URLs)."
)


_NOT_FOUND = (
    "No request with this key for this caller, running or finished (a finished one is forgotten"
    " after its retention)."
)
# The store cannot see uncommitted claims (its role may not read pg_locks): the same key's retry
# is the one safe way to find out (it waits for a running original, or runs it).
_UNSEEN = (
    "No finished request with this key for this caller; one still running may not show here."
    " Send it again with the same key (never a new one) to find out."
)
_RUNNING = "The request is running: ask again later, or send it again with the same key."
_NOTHING_RUNS = "Nothing runs this request any more: send it again with the same key."
_FINISHED = "The request has finished: send it again with the same key for its response."
# A 202's request (its Location's `request`: answers.request_digest) that was not the original.
_REQUEST = re.compile(r"[0-9a-f]{24}")
_OTHER_REQUEST = "Another request holds this key; yours did not run. Use a new key for it."
_ASKS = (
    " Send it again with the same key: the server asks the system it called what happened, then"
    " answers with the outcome or runs it again."
)
_NEW_KEY = " Never send it under a new key: it may have happened."


def _lapsed(policy: Policy | None) -> str:
    """A pending request whose lease lapsed: what its retry does under the route's policy now
    (a route may have changed its mode since the request was claimed)."""
    # ("May have": a lease lapses under a handler that still runs, too: its renewals renew
    # nothing while its own fenced transaction holds the record. A retry then waits for it.)
    if policy is None:  # (no middleware's startup check has told this route about it)
        return _LAPSED + ": send it again with the same key."
    if policy.mode is Mode.LEASE and policy.on_lease_expiry is LeaseExpiry.TAKEOVER:
        return _LAPSED + ": send it again with the same key to run it."
    if policy.mode is Mode.LEASE and policy.reconciler is not None:
        return _LAPSED + " with its outcome lost." + _ASKS
    # Transactional now, or no reconciler: the retry marks it unknown (409 outcome-unknown).
    return (
        _LAPSED + " with its outcome lost: sending it again with the same key waits for it if it"
        " still runs, and otherwise answers 409 outcome-unknown until an operator resolves it."
        + _NEW_KEY
    )


_LAPSED = "Its lease lapsed, and it may have stopped"


def _unknown(retry: bool, policy: Policy | None) -> str:
    if retry:
        return "Its outcome was lost." + _ASKS
    if policy is None:
        return (
            "Its outcome was lost. Sending it again with the same key settles it where the"
            " operation can ask the system it called; otherwise that answers 409 outcome-unknown"
            " until an operator resolves it." + _NEW_KEY
        )
    return (
        "Its outcome was lost, and this operation cannot find out what happened: an operator"
        " resolves it, and until then the same key answers 409 outcome-unknown." + _NEW_KEY
    )


def _retry_and_detail(
    record: Record, policy: Policy | None, by_hand: bool = False
) -> tuple[bool, str]:
    """Whether only the client's retry with the same key moves the request, and what the client
    should do next, in a sentence: both true of the route's policy as it is now."""
    state = record.state
    if state is State.PENDING:
        # Nothing but the client's own retry will move these (in either mode: a transactional
        # claim takes a released record over, and marks a lapsed one unknown). A client polling
        # for a change would otherwise poll a `pending` for good.
        if record.retry_allowed:
            return True, _NOTHING_RUNS
        if record.lease_expired:
            return True, _lapsed(policy)
        return False, _RUNNING
    if state is State.UNKNOWN:
        # The retry runs the route's reconciler, if it has one (lease mode only), never on a
        # transactional record an operator reopened (`by_hand`).
        retry = policy is not None and policy.reconciler is not None and not by_hand
        return retry, _unknown(retry, policy)
    return False, _FINISHED


def _answered(
    operation: str,
    state: State,
    response_status: int | None,
    retry: bool,
    detail: str,
    policy: Policy | None,
) -> Response:
    body = {
        "operation": operation,
        "state": state.value,
        "response_status": response_status,
        "retry": retry,
        "detail": detail,
    }
    response = Response(orjson.dumps(body), 200, media_type="application/json")
    if state is State.PENDING and not retry:
        # Still running: when to ask again (the route's `retry_after_seconds`, as its 409 says).
        after = 1 if policy is None else policy.retry_after_seconds
        response.headers["retry-after"] = str(after)
    return response


async def _operation_refused(store: Store, key: RecordKey) -> bool:
    """Whether the database refused the text of `key`'s operation (the client's, from the query:
    an emoji in a LATIN1 database), not its tenant (the server's). No record can have such an
    operation: a 404, never the server's `500 server-misconfigured` for a client's query. Told
    apart by looking the tenant up under an operation of ASCII, which every encoding carries."""
    if key.operation.isascii():
        return False
    try:
        await store.peek(key._replace(operation="GET /"))
    except StoreError:
        return False
    return True


def status_route(
    store: Store,
    *,
    path: str = "/idempotency/status",
    tenant_resolver: TenantResolver = authenticated_user_tenant,
    problem_base: str | None = None,
    www_authenticate: str | None = None,
) -> Route:
    """`GET path?operation=POST%20/payouts&key=abc`: the state of the caller's own request.

    The tenant comes from authentication, as for the guarded routes: another tenant's record
    with the same key is simply not found. The key is checked as the Idempotency-Key header is,
    the operation's shape too (400 problem+json); the answer is read from the caller's own
    record, or its own uncommitted claim (see the module's docstring). The key may come in the
    Idempotency-Key header instead (a token route's 202 leaves its token out of the URL).
    `"retry": true` marks a request only the client's retry with the same key moves: a pending
    one whose lease lapsed or that was released, an unknown one whose route has a reconciler
    (as the middleware's startup check told this route); `detail` says what to do. Pass the
    middleware's `tenant_resolver` and `www_authenticate` (its 401's challenge) if it has its
    own.
    `problem_base`: leave it out to answer under the base of the middleware whose startup check
    sees the route (`DEFAULT_PROBLEM_BASE` until one has); one of the route's own must be that
    middleware's, or its check fails.
    """
    if not any(callable(getattr(store, name, None)) for name in ("peek", "transaction")):
        # (None, say: every request a bare 500)
        raise ConfigurationError(f"status_route() takes the middleware's store, not {store!r}")
    tenants = Tenants(tenant_resolver, challenge=www_authenticate)
    # Filled by the middleware's startup check: whether an operation's route has a reconciler.
    operations = GuardedOperations("status", problem_base, store)

    def _problem(kind: ProblemKind, detail: str) -> Response:
        return problem_response(kind, detail, base=operations.base)

    async def status(request: Request) -> Response:
        response = await _answer(request)
        # A state that changes: no cache (a browser's, a proxy's) may answer the next poll with
        # this one, not even with the 404 of a request that has not committed yet (a 404 is
        # heuristically cacheable, like a 200).
        response.headers["cache-control"] = "no-store"
        return response

    async def _answer(request: Request) -> Response:
        tenant = await route_tenant(tenants, request.scope, problem_base=operations.base)
        if isinstance(tenant, Response):
            return tenant
        query = request.query_params
        if any(len(query.getlist(name)) > 1 for name in ("operation", "key", "request")):
            # (The last one would be read: a client could be told of another request than its.)
            return _problem(ProblemKind.INVALID_KEY, _REPEATED)
        operation = query.get("operation")
        key = query.get("key")
        try:
            # A one-time token is not put in a URL (a 202's Location leaves it out): the client
            # sends it as it sent the request, in the Idempotency-Key header.
            sent = parse_idempotency_key(request.scope["headers"])
            if key is not None and sent is not None and key != sent:
                return _problem(ProblemKind.INVALID_KEY, _TWO_KEYS)
            key = key or sent
            if not operation or not key:
                # (no key at all: `missing-key`, as a guarded route answers it)
                kind = ProblemKind.INVALID_KEY if key else ProblemKind.MISSING_KEY
                return _problem(kind, _NO_KEY)
            check_key(key)  # exactly the header's rule: a 400, never a query with a bad value
        except RequestRejected as exc:
            return _problem(exc.kind, exc.detail)
        if LOOKED_UP_SHAPE.fullmatch(operation) is None:
            return _problem(ProblemKind.INVALID_KEY, _BAD_OPERATION)
        request_seen = query.get("request")
        if request_seen is not None and _REQUEST.fullmatch(request_seen) is None:
            return _problem(ProblemKind.INVALID_KEY, "The request is as a 202's Location gives it.")
        policy = operations.policy(operation)
        if policy is not None and policy.require_token and query.get("key") is not None:
            return _problem(ProblemKind.INVALID_KEY, _TOKEN_IN_URL)
        by_hand = False
        try:
            record, claiming = await store.peek(RecordKey(tenant, operation, key))
            reconciled = policy is not None and policy.reconciler is not None
            if record is not None and record.state is State.UNKNOWN and reconciled:
                # Only here is it asked: a record an operator reopened (a transactional one's
                # too) is not reconciled, whatever the route's policy now.
                summary = await store.describe(record.key)
                by_hand = summary is not None and summary.by_hand
        except TextRefused as exc:
            if await _operation_refused(store, RecordKey(tenant, operation, key)):
                return _problem(ProblemKind.RECORD_NOT_FOUND, _NOT_FOUND)
            # (a tenant the database cannot take: the server's)
            return problem_response(exc.problem, exc.detail, base=operations.base)
        except StoreError as exc:
            if exc.problem is ProblemKind.MISCONFIGURED:
                return problem_response(exc.problem, exc.detail, base=operations.base)
            # As the guarded routes answer it: a 503 to retry, not a bare 500.
            return problem_response(
                ProblemKind.STORE_UNAVAILABLE,
                "The request's status cannot be read right now; ask again.",
                base=operations.base,
                retry_after=1,
            )
        if claiming:  # a transaction is claiming it: running, its record not committed yet
            return _answered(operation, State.PENDING, None, False, _RUNNING, policy)
        if record is None or record.expired:
            return _problem(
                ProblemKind.RECORD_NOT_FOUND, _NOT_FOUND if claiming is False else _UNSEEN
            )
        if (
            request_seen is not None
            and not record.retry_allowed  # (released: the key is free, a retry runs the request)
            and request_seen != request_digest(record.fingerprint)
        ):
            return _problem(ProblemKind.KEY_REUSED, _OTHER_REQUEST)
        retry, detail = _retry_and_detail(record, policy, by_hand)
        status = None if record.response is None else record.response.status
        return _answered(operation, record.state, status, retry, detail, policy)

    setattr(status, ROUTE_RESOLVER_ATTRIBUTE, tenant_resolver)  # (see startup's check)
    setattr(status, ROUTE_TENANTS_ATTRIBUTE, tenants)
    setattr(status, ROUTE_OPERATIONS_ATTRIBUTE, operations)
    return LibraryRoute(path, status, method="GET", name="idempotency_status")

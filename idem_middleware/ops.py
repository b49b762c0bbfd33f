"""Operator functions: find, resolve and reconcile the records nobody retries.

The CLI is a thin adapter over these; they work on any Store.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Collection, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

import orjson

from .errors import ResolveError as ResolveError
from .fence import Verdict, run_reconciler
from .middleware import IdempotencyMiddleware
from .policy import Policy, endpoint_policy, operation_name
from .reconcile import Reconciler
from .routing import Found, routes_of
from .startup import guarded_routes
from .store.base import (
    FINAL_STATES,
    RecordKey,
    RecordSummary,
    Settlement,
    State,
    Store,
    StoredResponse,
)

#: How many wrapping middlewares are looked through for the IdempotencyMiddleware.
_MAX_WRAPPERS = 32


class Resolution(StrEnum):
    SUCCEEDED = "succeeded"
    FAILED_FINAL = "failed_final"
    #: It did not happen: the client's next retry (same key, same body) runs it again.
    RETRY = "retry"


@dataclass(frozen=True, slots=True)
class Move:
    """What an operator's move did: the record's state before and after."""

    before: State
    after: State
    status: int | None = None


# RFC 9110 token (header names, media types) and field-value characters (no CR, LF or NUL).
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_MEDIA_TYPE = re.compile(
    r"(?P<type>[!#$%&'*+.^_`|~0-9A-Za-z-]+)/(?P<sub>[!#$%&'*+.^_`|~0-9A-Za-z-]+)"
    r'(?:[ \t]*;[ \t]*[!#$%&\'*+.^_`|~0-9A-Za-z-]+=(?:[!#$%&\'*+.^_`|~0-9A-Za-z-]+|"[^"\\]*"))*'
)
_FIELD_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
_NO_BODY_STATUSES = frozenset({204, 205, 304})


def operator_response(
    to: Resolution, status: int, body: bytes = b"", content_type: str = "application/json"
) -> StoredResponse:
    """The response an operator's resolution stores, validated as `check_response` does."""
    headers = [(b"content-type", content_type.strip().encode("latin-1"))] if body else []
    response = StoredResponse(status, headers, body)
    check_response(to, response)
    return response


def check_response(to: Resolution, response: StoredResponse) -> None:
    """Refuse (ValueError) a response that would break the key: every retry replays it until
    the record expires, so a status the server cannot send or a body its content type denies
    would be served for the whole retention."""
    status = response.status
    if not 100 <= status <= 599:
        raise ValueError(f"status {status} is not an HTTP status (100-599)")
    if to is Resolution.SUCCEEDED and not 200 <= status <= 399:
        raise ValueError(
            f"a succeeded record replays a 2xx or 3xx status, not {status} "
            "(a final refusal is --to failed_final with a 4xx)"
        )
    if to is Resolution.FAILED_FINAL and not 400 <= status <= 499:
        raise ValueError(
            f"a failed_final record replays a 4xx status, not {status} "
            "(a 5xx is not final: leave the record unknown, or --to retry)"
        )
    if status in _NO_BODY_STATUSES and response.body:
        raise ValueError(f"a {status} response has no body")
    content_type = ""
    for name, value in response.headers:
        text = value.decode("latin-1")
        if not _TOKEN.fullmatch(name.decode("latin-1")) or not _FIELD_VALUE.fullmatch(text):
            raise ValueError(f"header {name!r}: {value!r} is not a valid HTTP header")
        if name.lower() == b"content-type":
            content_type = text.strip()
    if not response.body:
        return
    media = _MEDIA_TYPE.fullmatch(content_type)
    if media is None:
        raise ValueError(
            f"content type {content_type!r} is not a media type (type/subtype[; name=value])"
        )
    sub = media["sub"].lower()
    if media["type"].lower() == "application" and (sub == "json" or sub.endswith("+json")):
        try:
            orjson.loads(response.body)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"the body is not valid JSON ({content_type}): {exc}") from None


def _audit_line(
    action: str, before: RecordSummary, after: State, status: int | None, note: str
) -> str:
    old = f" {before.response_status}" if before.response_status is not None else ""
    new = f" {status}" if status is not None else ""
    return f"{action} {before.state.value}{old} -> {after.value}{new}: {note}"


def _note(note: str) -> str:
    text = " ".join(note.split())  # one line per move in the audit trail
    if not text:
        raise ValueError("an audit note is required")
    return text


async def _record(store: Store, key: RecordKey) -> RecordSummary:
    summary = await store.describe(key)
    if summary is None:
        raise ResolveError(
            "no record holds this key (check the tenant, the operation and the key; a finished "
            "record is purged after its retention)"
        )
    return summary


async def resolve(
    store: Store,
    key: RecordKey,
    to: Resolution,
    *,
    note: str,
    response: StoredResponse | None = None,
    again: bool = False,
) -> Move:
    """Settle an `unknown` record by hand, with a line for its audit trail.

    With `again`, a record already succeeded or failed_final is resolved anew (its old outcome
    stays in the audit trail). `succeeded` and `failed_final` only store the response retries
    get: no handler runs and no business write is made.
    """
    text = _note(note)
    if to is not Resolution.RETRY:
        if response is None:
            raise ValueError(f"resolving to {to.value} needs the status to replay")
        check_response(to, response)
    record = await _record(store, key)
    # A transactional record is committed with its outcome, never pending: one that reads
    # pending was released for a retry by an older version's reconcile, and nothing else can
    # ever settle it (no lease lapses), so an operator may, to an outcome (never a retry).
    wedged = record.state is State.PENDING and record.mode != "lease"
    if record.state is State.PENDING and not wedged:
        raise ResolveError(
            "only unknown records can be resolved; this one is pending (a request is running "
            "it, or it is released for the client's retry)"
        )
    if record.state in FINAL_STATES and not again:
        raise ResolveError(
            f"only unknown records can be resolved; this one is {record.state.value} (pass "
            "--again to replace the outcome its retries get, or reopen it)"
        )
    if to is Resolution.RETRY and record.mode != "lease":
        raise ResolveError(
            "a transactional-mode record cannot be released for a retry: its handler's writes "
            "committed with its outcome"
        )
    after = State.PENDING if to is Resolution.RETRY else State(to.value)
    status = None if response is None else response.status
    action = "re-resolve" if record.state in FINAL_STATES else "resolve"
    line = _audit_line(action, record, after, status, text)
    if not await store.amend(
        key, record.generation, record.state, Settlement(after, response, note=line)
    ):
        raise ResolveError("the record changed while it was being resolved; look at it again")
    return Move(record.state, after, status)


async def reopen(store: Store, key: RecordKey, *, note: str) -> Move:
    """Turn a succeeded or failed_final record back to `unknown`: retries get 409
    outcome-unknown until it is resolved again (or reconciled, in lease mode)."""
    text = _note(note)
    record = await _record(store, key)
    if record.state not in FINAL_STATES:
        raise ResolveError(
            f"only succeeded or failed_final records can be reopened; this one is "
            f"{record.state.value}"
        )
    line = _audit_line("reopen", record, State.UNKNOWN, None, text)
    moved = await store.amend(
        key, record.generation, record.state, Settlement(State.UNKNOWN, None, note=line)
    )
    if not moved:
        raise ResolveError("the record changed while it was being reopened; look at it again")
    return Move(record.state, State.UNKNOWN)


#: The most unknown records one `reconcile_unknown` looks at (every loop is bounded).
_MAX_SCANNED = 1_000_000
#: The longest `reconcile_unknown` waits for a record another session holds (an executor's or a
#: reconciler's fenced transaction, or a process paused holding one) before passing it over.
_HELD_WAIT = 1.0

_T = TypeVar("_T")


class _Held(Exception):
    """Another session held the record's row for longer than `_HELD_WAIT`."""


async def _unless_held(move: Awaitable[_T], seconds: float) -> _T:
    try:
        async with asyncio.timeout(seconds):
            return await move
    except TimeoutError:
        raise _Held from None


@dataclass
class ReconcileReport:
    examined: int = 0
    expired_leases: int = 0
    verdicts: dict[str, int] = field(default_factory=dict)
    #: Operations that had unknown records but no reconciler.
    unreconcilable: dict[str, int] = field(default_factory=dict)
    #: Operations whose unknown records are transactional-mode (reopened by an operator): no
    #: reconciler runs on them, since a transactional record's writes committed with its
    #: outcome and cannot be released for a retry; settle them with `resolve`.
    by_hand: dict[str, int] = field(default_factory=dict)
    #: Records passed over because another session held them (an executor or a reconciler at
    #: work, or a process paused while it held one): the next run looks at them again.
    held: int = 0


async def reconcile_unknown(
    store: Store,
    reconcilers: Mapping[str, Reconciler],
    *,
    tenant: str | None = None,
    operation: str | None = None,
    limit: int = 100,
    seconds: float = 10.0,
    takeover: Collection[str] = (),
) -> ReconcileReport:
    """Settle unknown records (and pending ones whose lease lapsed) by asking their reconcilers.

    `Happened` settles the record; `NotHappened` lets the client's next retry run it again.
    Only lease-mode records are reconciled: transactional ones are counted in `by_hand`.
    `takeover` names the operations whose lapsed leases the client's retry takes over
    (`LeaseExpiry.TAKEOVER`): without a reconciler, theirs are left pending for it, since
    `unknown` would refuse that retry until an operator came.
    """
    report = ReconcileReport()
    # A record another session holds is passed over, not waited for: an executor holding its
    # fenced transaction past its lease, or paused with it, would stop the whole batch.
    held_wait = min(seconds, _HELD_WAIT)
    stale = await store.list_records(
        states=[State.PENDING], tenant=tenant, operation=operation, limit=limit, stale_only=True
    )
    for summary in stale:
        op = summary.key.operation
        if not summary.lease_expired or (op in takeover and op not in reconcilers):
            continue
        try:
            if await _unless_held(store.expire_lease(summary.key, summary.generation), held_wait):
                report.expired_leases += 1
        except _Held:
            report.held += 1
    # `limit` bounds the reconcilers run, not the records looked at: records no reconciler can
    # settle (transactional ones, operations without one) are passed over, oldest first, so that
    # however many of them wait for an operator they never keep the others from their turn.
    seen: set[RecordKey] = set()
    runs = 0
    window = limit
    while runs < limit and window <= _MAX_SCANNED:
        unknown = await store.list_records(
            states=[State.UNKNOWN], tenant=tenant, operation=operation, limit=window
        )
        fresh = [summary for summary in unknown if summary.key not in seen]
        for summary in fresh:
            if runs == limit:
                break
            seen.add(summary.key)
            report.examined += 1
            op = summary.key.operation
            if summary.mode != "lease":
                report.by_hand[op] = report.by_hand.get(op, 0) + 1
                continue
            reconciler = reconcilers.get(op)
            if reconciler is None:
                report.unreconcilable[op] = report.unreconcilable.get(op, 0) + 1
                continue
            runs += 1
            try:
                verdict = await _reconcile_one(store, summary, reconciler, seconds, held_wait)
            except _Held:
                report.held += 1
                continue
            report.verdicts[verdict.value] = report.verdicts.get(verdict.value, 0) + 1
        if not fresh or len(unknown) < window:
            break  # every unknown record has been looked at
        # Settled ones leave the list; the next window reaches past those passed over.
        window = len(seen) + limit
    return report


async def _reconcile_one(
    store: Store, summary: RecordSummary, reconciler: Reconciler, seconds: float, held_wait: float
) -> Verdict:
    result = await run_reconciler(
        store, summary.key, summary.generation, reconciler, seconds=seconds, epoch=summary.epoch
    )
    if result.verdict is Verdict.NOT_HAPPENED:
        retry = store.allow_retry(summary.key, summary.generation, "reconciled: not happened")
        if not await _unless_held(retry, held_wait):
            return Verdict.CHANGED  # someone else moved it meanwhile
    return result.verdict


@dataclass(frozen=True, slots=True)
class GuardedOperation:
    method: str
    #: The route template, as the operation name uses it (`/items/{item_id:int}`).
    template: str
    #: The same path as OpenAPI writes it (`/items/{item_id}`).
    path_format: str
    policy: Policy

    @property
    def name(self) -> str:
        return operation_name(self.method, self.template)


def guarded_operations(app: Any) -> list[GuardedOperation]:
    """Every guarded operation of a Starlette/FastAPI app and its policy, resolved by the app's
    own IdempotencyMiddleware exactly as at startup (`startup.guarded_routes`): through Host,
    Mount and included routers. Without a middleware, only endpoints with their own policy."""
    routes = routes_of(app)
    if routes is None:
        return []
    middleware = find_middleware(app)
    policy_for = _own_policy if middleware is None else middleware.policy_for
    return [
        GuardedOperation(method, item.template, item.path_format, policy)
        for item, method, policy in guarded_routes(routes, policy_for)
    ]


def find_middleware(app: Any) -> IdempotencyMiddleware | None:
    """The IdempotencyMiddleware that serves `app`: the one running (in its middleware stack, or
    wrapping it), else one built from its `add_middleware` arguments, as Starlette will build it."""
    for start in (getattr(app, "middleware_stack", None), app):
        layer = start
        for _ in range(_MAX_WRAPPERS):
            if layer is None:
                break
            if isinstance(layer, IdempotencyMiddleware):
                return layer
            layer = getattr(layer, "app", None)
    for entry in getattr(app, "user_middleware", ()):
        cls = entry.cls
        if isinstance(cls, type) and issubclass(cls, IdempotencyMiddleware):
            return cls(app.router, *entry.args, **entry.kwargs)
    return None


def collect_policies(app: Any) -> dict[str, Policy]:
    return {op.name: op.policy for op in guarded_operations(app)}


def collect_reconcilers(app: Any) -> dict[str, Reconciler]:
    """The reconciler of every guarded operation that has one (for `idem-middleware reconcile`)."""
    return {
        name: policy.reconciler
        for name, policy in collect_policies(app).items()
        if policy.reconciler is not None
    }


def _own_policy(method: str, route: Found) -> Policy | None:
    policy = endpoint_policy(route.endpoint)
    return policy if policy is not None and policy.guard else None

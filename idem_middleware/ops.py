"""Operator functions: find, resolve and reconcile the records nobody retries.

The CLI is a thin adapter over these; they work on any Store.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson

from .endpoints import endpoint_policy
from .errors import ResolveError as ResolveError
from .mounted import find_middleware as find_middleware
from .mounted import mounted_middlewares
from .policy import Policy, operation_name
from .reconcile import Reconciler
from .reconcile_batch import Held, unless_held
from .reconcile_batch import ReconcileReport as ReconcileReport
from .reconcile_batch import reconcile_unknown as reconcile_unknown
from .responses import storable_headers
from .routing import Found, listed_routes
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
#: Statuses that ask the client to try again (after authenticating, later, or less early).
_RETRY_LATER = frozenset({401, 408, 425, 429})


def operator_response(
    to: Resolution, status: int, body: bytes = b"", content_type: str = "application/json"
) -> StoredResponse:
    """The response an operator's resolution stores, validated as `check_response` does."""
    if not isinstance(content_type, str):
        raise TypeError(f"content_type is a str, not {type(content_type).__name__}")
    headers = [(b"content-type", content_type.strip().encode("latin-1"))] if body else []
    response = StoredResponse(status, headers, body)
    check_response(to, response)
    return response


def check_response(to: Resolution, response: StoredResponse) -> None:
    """Refuse (ValueError) a response that would break the key: every retry replays it until
    the record expires, so a status the server cannot send or a body its content type denies
    would be served for the whole retention. Its types too, as a reconciler's `Happened`'s: a
    str body was stored, and every retry's replay failed (a 500 for the whole retention)."""
    status, body, headers = response.status, response.body, response.headers
    if isinstance(status, bool) or not isinstance(status, int):
        raise ValueError(f"the status is an int (an HTTP status), not {type(status).__name__}")
    if not isinstance(body, bytes):
        raise ValueError(f"the body is bytes (encode it), not {type(body).__name__}")
    if isinstance(headers, str | bytes) or not all(
        isinstance(pair, tuple | list)
        and len(pair) == 2
        and all(isinstance(p, bytes) for p in pair)
        for pair in headers
    ):
        raise ValueError("the headers are (bytes, bytes) pairs")
    if len(storable_headers(headers)) != len(headers):  # (replays leave them out: said now)
        raise ValueError(
            "the headers hold one a replay never repeats (framing or hop-by-hop: Content-Length,"
            " Transfer-Encoding, Connection and those it names, ...): leave it out"
        )
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
    if to is Resolution.FAILED_FINAL and status in _RETRY_LATER:
        raise ValueError(
            f"a failed_final record replays its status to every retry until it expires, and "
            f"{status} tells the client to retry (the middleware never stores it): --to retry, "
            "or a final 4xx"
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


#: The longest audit note (characters, its whitespace runs as one space): a line of the record's
#: audit trail, which every `show` and `list` prints (a 2 MB note was kept whole).
MAX_NOTE_CHARS = 1000


def checked_note(note: str) -> str:
    """The audit note as the trail keeps it (one line); ValueError for one it cannot keep."""
    if not isinstance(note, str):
        raise TypeError(f"an audit note is a str, not {type(note).__name__}")
    text = " ".join(note.split())  # one line per move in the audit trail
    if not text:
        raise ValueError("an audit note is required")
    if len(text) > MAX_NOTE_CHARS:
        raise ValueError(
            f"an audit note is at most {MAX_NOTE_CHARS} characters, not {len(text)}: keep the"
            " details elsewhere and name them"
        )
    # (Refused before any statement, as the CLI's `audit_note` does: the database's refusal was
    # a StoreError, or the driver's own DataError for a lone surrogate, after the record's read.)
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError("an audit note is UTF-8 text (it holds a lone surrogate)") from None
    if "\0" in text:
        raise ValueError("an audit note holds a NUL character, which the database refuses")
    return text


#: What `show`, `resolve` and `reopen` say of a key a transactional request is running: its
#: claim holds the key's lock, and its record is written only when it commits.
RUNNING = (
    "a request is running this key now (a transactional claim holds it; its record is written "
    "when it commits): look at it again (show) once it is done"
)


#: What they say of a key no record holds, and no request runs.
NOT_FOUND = "no record holds this key"


async def running(store: Store, key: RecordKey) -> bool:
    """Whether a request is running `key`, of which `describe` found no record: a transactional
    claim has none until it commits ("no record holds this key" sent the operator looking for a
    typo or a purge while the request ran)."""
    _, claiming = await store.peek(key)
    return bool(claiming)


async def _record(store: Store, key: RecordKey) -> RecordSummary:
    summary = await store.describe(key)
    if summary is None:
        raise ResolveError(
            RUNNING
            if await running(store, key)
            else f"{NOT_FOUND} (check the tenant, the operation and the key; a finished record "
            "is purged after its retention)"
        )
    return summary


#: The longest `resolve` and `reopen` wait for a record another session holds. (The server gives
#: the statement up a second later on its own, queries.sql `amend`: a client lost meanwhile
#: leaves no statement waiting, to land once the row is free.)
_BUSY_WAIT = 5.0


async def _unless_busy(amend: Awaitable[bool]) -> bool:
    """An operator's move, waiting at most `_BUSY_WAIT` for the record's row: a reconciler's
    fenced transaction holds it while it asks the downstream service, and a process paused
    holding one would hold it for good."""
    try:
        return await unless_held(amend, _BUSY_WAIT)
    except Held:
        raise ResolveError(
            f"another session held this record for over {_BUSY_WAIT:g} s (a request or a "
            "reconciler working on it): look at it again (show) and retry"
        ) from None


def _resolution(to: Any) -> Resolution:
    """`to` as the Resolution it names (its value, `"succeeded"`, too: compared by identity,
    it was an AttributeError from inside)."""
    try:
        return Resolution(to)
    except ValueError:
        valid = ", ".join(repr(r.value) for r in Resolution)
        raise ValueError(f"resolve: to is a Resolution ({valid}), not {to!r:.60}") from None


async def resolve(
    store: Store,
    key: RecordKey,
    to: Resolution | str,
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
    text = checked_note(note)
    to = _resolution(to)
    if not isinstance(again, bool):  # ("false" was true, and replaced a final outcome)
        raise TypeError(f"again is True or False, not {type(again).__name__}")
    if to is not Resolution.RETRY:
        if response is None:
            raise ValueError(f"resolving to {to.value} needs the status to replay")
        check_response(to, response)
    record = await _record(store, key)
    # A transactional record is committed with its outcome, never pending: one that reads
    # pending was released for a retry by an older version's reconcile, and nothing else can
    # ever settle it (no lease lapses), so an operator may, to an outcome (never a retry).
    wedged = record.state is State.PENDING and record.mode != "lease"
    # A lease-mode record whose lease lapsed (its process died), or one released for a retry
    # (no lease), that nothing takes over (its retry refused `422` once the fingerprint's
    # options changed, or never sent) is resolved like an unknown one, to an outcome. The store
    # refuses the move if its lease was renewed since it was read (an execution still runs it),
    # and a retry taking a released record over draws a new generation.
    released = record.mode == "lease" and record.lease_expires_at is None
    lapsed = record.mode == "lease" and not released and record.lease_expired
    if record.state is State.PENDING and not (wedged or lapsed or released):
        raise ResolveError(
            "only unknown records can be resolved; this one is pending (a request is running it)"
        )
    if record.state is State.PENDING and released and to is Resolution.RETRY:
        raise ResolveError("this record is released for the client's retry already")
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
    amend = store.amend(
        key, record.generation, record.state, Settlement(after, response, note=line)
    )
    if not await _unless_busy(amend):
        raise ResolveError("the record changed while it was being resolved; look at it again")
    return Move(record.state, after, status)


async def reopen(store: Store, key: RecordKey, *, note: str) -> Move:
    """Turn a succeeded or failed_final record back to `unknown`: retries get 409
    outcome-unknown until it is resolved again, by hand (no reconciler runs on it, in either
    mode: writes may have committed with its outcome, see `RecordSummary.by_hand`)."""
    text = checked_note(note)
    record = await _record(store, key)
    if record.state not in FINAL_STATES:
        raise ResolveError(
            f"only succeeded or failed_final records can be reopened; this one is "
            f"{record.state.value}"
        )
    line = _audit_line("reopen", record, State.UNKNOWN, None, text)
    amend = store.amend(key, record.generation, record.state, Settlement(State.UNKNOWN, note=line))
    if not await _unless_busy(amend):
        raise ResolveError("the record changed while it was being reopened; look at it again")
    return Move(record.state, State.UNKNOWN)


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
        return operation_name(self.method, self.template, self.policy)


def guarded_operations(app: Any) -> list[GuardedOperation]:
    """Every guarded operation of a Starlette/FastAPI app and its policy, resolved by the app's
    own IdempotencyMiddleware exactly as at startup (`startup.guarded_routes`): through Host,
    Mount and included routers. Without a middleware, endpoints with their own policy, and the
    routes the middleware of a Mount or of a mounted app guards (`mounted.mounted_middlewares`)."""
    routes = listed_routes(app)  # (its router's default app's too)
    if routes is None:  # (nothing was a silent no-op: a reconcile run built on it did nothing)
        raise TypeError(
            f"guarded_operations takes a Starlette or FastAPI app (or its router), not a "
            f"{type(app).__name__}: pass the app itself, not a factory or a wrapper of it"
        )
    middleware = find_middleware(app)
    if middleware is not None:
        found = guarded_routes(routes, middleware.policy_for)
        return [GuardedOperation(m, i.template, i.path_format, p) for i, m, p in found]
    # Without a middleware of the app's own: endpoints with policies of their own, and what
    # the middleware of a Mount or of a mounted app guards below it.
    operations = {
        (m, i.template): GuardedOperation(m, i.template, i.path_format, p)
        for i, m, p in guarded_routes(routes, _own_policy)
    }
    for inner, items in mounted_middlewares(routes):
        for i, m, p in guarded_routes(routes, inner.policy_for, items):
            operations[m, i.template] = GuardedOperation(m, i.template, i.path_format, p)
    return list(operations.values())


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
    policy = endpoint_policy(route.endpoint, method)
    return policy if policy is not None and policy.guard else None

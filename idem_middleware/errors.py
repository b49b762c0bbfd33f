"""The library's exceptions, and the kinds of problem a client can be told about."""

from __future__ import annotations

import logging
import time
from enum import StrEnum
from typing import TypeGuard


class ProblemKind(StrEnum):
    """Each kind of refusal a client can see; the value is the stable suffix of its `type` URI."""

    MISSING_KEY = "missing-key"
    INVALID_KEY = "invalid-key"
    KEY_REUSED = "key-reused"
    IN_FLIGHT = "request-in-flight"
    OUTCOME_UNKNOWN = "outcome-unknown"
    BODY_INVALID = "body-invalid"
    BODY_TOO_LARGE = "body-too-large"
    TOO_MANY_FIELDS = "too-many-fields"
    UNAUTHENTICATED = "unauthenticated"
    STORE_UNAVAILABLE = "store-unavailable"
    RECORD_NOT_FOUND = "record-not-found"
    TOKEN_INVALID = "token-invalid"
    #: The server's own setup is wrong (no authentication before the middleware, say).
    MISCONFIGURED = "server-misconfigured"
    TENANT_BUSY = "tenant-busy"
    #: The token route only: the intent's token was issued for another request or secret, or
    #: was used and has expired.
    TOKEN_CONFLICT = "token-conflict"
    #: The server cancelled the request before it was answered (its shutdown's graceful timeout).
    CANCELLED = "request-cancelled"
    #: The library's own routes only: a method they do not serve (with `Allow`).
    METHOD_NOT_ALLOWED = "method-not-allowed"
    #: The request's own method or path names its operation (a route taking any method, a mount
    #: the middleware cannot see through), and the name is one no record can hold.
    OPERATION_INVALID = "operation-invalid"


class IdempotencyError(Exception):
    """Base class of every exception this library raises."""


class RequestRejected(IdempotencyError):
    """A request refused before anything was claimed; the middleware turns it into problem+json."""

    def __init__(self, kind: ProblemKind, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


class StoreError(IdempotencyError):
    """The store could not do what was asked (connection lost, server gone)."""

    #: What a request meeting it is told (unless its response has started), and how it is logged.
    problem = ProblemKind.STORE_UNAVAILABLE
    detail = (
        "The request was not processed, or its outcome is not yet known; retry it with the same "
        "Idempotency-Key."
    )
    retry_after: int | None = 1
    log_level = logging.WARNING
    log_message = "idempotency store unavailable"


#: How often one kind of store failure (its class and its cause's) logs its traceback: every
#: request meeting one logs its line, but an outage fails every request, and a traceback each
#: was thousands a minute. (Lease renewals log one per outage: heartbeat.)
TRACEBACK_EVERY_SECONDS = 60.0
#: When each kind last logged its traceback (a few kinds: cleared past `_KINDS_KEPT`).
_traced: dict[tuple[type[BaseException], type[BaseException] | None], float] = {}
_KINDS_KEPT = 64


def traceback_due(exc: StoreError) -> bool:
    """Whether a request's store failure logs its traceback: the first of its kind in each
    `TRACEBACK_EVERY_SECONDS`, in this process."""
    cause = exc.__cause__ or exc.__context__
    kind = (type(exc), None if cause is None else type(cause))
    now = time.monotonic()
    last = _traced.get(kind)
    if last is not None and now - last < TRACEBACK_EVERY_SECONDS:
        return False
    if len(_traced) >= _KINDS_KEPT:
        _traced.clear()
    _traced[kind] = now
    return True


class StoreClosed(StoreError):
    """The store refuses all work here: it is closed, was never opened, or its pool belongs to
    another event loop. Unlike a lost connection, asking again cannot help (a settlement that
    meets it is not sent again)."""


#: How to open the store, and what a store that was never opened says.
OPEN_IN_LIFESPAN = (
    "open it in the app's lifespan (lifespan=store_lifespan(store), or `async with store:` "
    "around the lifespan's yield)"
)
NOT_OPEN = (
    f"the store is not open: {OPEN_IN_LIFESPAN} and let the lifespan run (Starlette's TestClient "
    "runs it only as a context manager, `with TestClient(app) as client:`; httpx's ASGITransport "
    "never does), or `await store.open()` first"
)
#: The end of the error an endpoint needing a claim raises when none is active.
NO_CLAIM_HINT = (
    "is IdempotencyMiddleware installed and enabled (not switched off by "
    "IDEM_MIDDLEWARE_DISABLED or enabled=False), the route guarded and its key required?"
)
#: What a store used (or opened again) in another event loop than its pool's says.
OTHER_LOOP = (
    "the store's asyncpg pool belongs to another event loop than this one, and its connections "
    "work only in their own. Open and use the store in one loop: the one that serves the app "
    "(Starlette's TestClient serves it in a loop of its own: give the app a store of its own, "
    "opened by the app's lifespan); in tests, make a store fixture in the tests' loop (the same "
    "loop scope for the fixture and the tests); to open it in another loop, close it first"
)


class StaleGeneration(IdempotencyError):
    """A completion, heartbeat or fenced write under a generation that is no longer current."""


class ConfigurationError(IdempotencyError):
    """The middleware or a policy was configured inconsistently."""


class ResolveError(IdempotencyError):
    """The record is not there, or not unknown any more."""


# -- claims and transactions ----------------------------------------------------------------------


class ClaimTimeout(IdempotencyError):
    """The wait for another transaction's claim on the same key ran out."""


class ClaimBusy(ClaimTimeout):
    """Another transaction is claiming the key right now. A transactional claim never waits for
    it inside the database: the caller rolls back (giving its connection back), waits, and
    claims again."""


class RetryableConflict(IdempotencyError):
    """A serialization failure or deadlock: the transaction can be run again from the start.

    `from_handler`: the handler's own writes met it (the cause is the error the handler raised,
    which is what propagates once the transaction cannot be run again)."""

    def __init__(self, message: str, *, from_handler: bool = False) -> None:
        super().__init__(message)
        self.from_handler = from_handler


class ClientGone(IdempotencyError):
    """The client disconnected while a transactional handler ran; its work was rolled back."""


class StatementRefused(StoreError):
    """The database refused one statement (a constraint, a trigger) on a connection that is
    still usable."""


class TextRefused(StatementRefused):
    """The database's encoding cannot store the request's tenant, operation or key (an emoji in
    a LATIN1 database), or its index cannot hold them (too long). Nothing was written, and the
    same request would fail the same way: the client gets `500 server-misconfigured`, not a 503
    that asks for a retry."""

    problem = ProblemKind.MISCONFIGURED
    detail = (
        "The request was not processed: the database cannot store its tenant, operation or key "
        "(in its encoding, or at their length). The server is misconfigured."
    )
    retry_after = None
    log_level = logging.ERROR
    log_message = "idempotency: the database cannot store the request's names"


class ClaimRefused(StatementRefused):
    """The database refused the claim's own statements with an error no retry clears (a
    privilege revoked since the store opened, a row-level security policy, a trigger on the
    table): nothing was claimed and the handler did not run. The client gets `500
    server-misconfigured` as a problem document (it was the server's bare 500), and the log
    names the error (without its DETAIL, which quotes the row)."""

    problem = ProblemKind.MISCONFIGURED
    detail = (
        "The request was not processed: the database refused its claim. The server is "
        "misconfigured."
    )
    retry_after = None
    log_level = logging.ERROR
    log_message = "idempotency: the database refused the claim"


class SettlementRefused(StatementRefused):
    """Transactional mode: the database refused to record the handler's outcome because of what
    the handler did in the claim's transaction (it went on after one of its statements failed,
    which aborted the transaction; `SET ROLE`; a `search_path` without the store's schema; a
    deferred constraint of its writes). Nothing of the transaction is committed and the key is
    free: the client gets `500 server-misconfigured`, never the handler's answer."""

    problem = ProblemKind.MISCONFIGURED
    detail = (
        "The request was not processed: its outcome could not be recorded, and nothing of it was "
        "committed. The server is misconfigured."
    )
    retry_after = None
    log_level = logging.ERROR
    log_message = "idempotency: the handler's outcome could not be recorded"


class FencedSettlementRefused(SettlementRefused):
    """Lease mode: the same, for the execution's fenced transaction. Its writes there rolled
    back; what the handler did outside the database may have happened, so the record is marked
    `unknown` (a retry gets `409 outcome-unknown` until a reconciler or an operator resolves
    it), and the client gets `500 server-misconfigured`, never the handler's answer."""

    detail = (
        "The request's outcome could not be recorded: nothing it wrote to the database was "
        "committed, and what it did elsewhere is not known, so it is not run again until its "
        "outcome is resolved. The server is misconfigured."
    )


class CallerNamedLate(SettlementRefused):
    """A request guarded as anonymous (a route that allows anonymous callers, no caller named
    when it was claimed) whose tenant resolver names a caller by the time its outcome is to be
    recorded: authentication ran inside the middleware (an AuthenticationMiddleware or a
    BaseHTTPMiddleware after it, one in a mounted app, a resolver reading what the router sets).
    Recorded under the anonymous tenant, its response would be replayed to any caller sending the
    same key. Nothing is recorded (transactional: nothing committed, the key free; lease mode:
    the record `unknown`), and the client gets `500 server-misconfigured`."""

    detail = (
        "The request's outcome was not recorded: the server identified its caller only after "
        "the idempotency check had taken it for an anonymous one. The server is misconfigured."
    )
    log_message = (
        "idempotency: a request guarded as anonymous was authenticated inside "
        "IdempotencyMiddleware, so its outcome was not recorded (it would be replayed to "
        "every caller): authentication must run before IdempotencyMiddleware (add it after "
        "install(...), or before it in a middleware=[...] list)"
    )


# -- tokens and jobs -------------------------------------------------------------------------------


class TokenConflict(IdempotencyError):
    """The intent was already issued a token for another request, or under another secret, or
    its token was used and has expired (a used token is never renewed)."""


class EventConflict(IdempotencyError):
    """An outbox event id added again with another tenant, topic or payload."""


class JobInProgress(IdempotencyError):
    """Another run holds the key and did not finish within `wait_seconds`: retry later."""


class JobKeyReused(IdempotencyError):
    """The key was used with different arguments."""


class JobOutcomeUnknown(IdempotencyError):
    """Lease mode: an earlier run ended without an outcome; it is not run again until resolved."""


# -- signals inside the library (never raised to a caller) ----------------------------------------


class InvalidJson(ValueError):
    """Carries a client-facing detail out of the JSON decoder's hooks (fingerprint_json.py); it
    becomes a `RequestRejected(BODY_INVALID)`."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class FenceRollback(Exception):
    """Thrown into a fenced transaction's context to end it without committing (fence.py)."""


class NotFusable(Exception):
    """A value the fast path cannot inline, or a connection it cannot use: the store takes the
    ordinary path instead (store/postgres/fused.py)."""


def missing_extra(module: str, extra: str, exc: ImportError) -> ModuleNotFoundError:
    """The error for `module` imported without its extra: Python's own ("No module named
    'fastapi'") named neither the extra nor the command that installs it."""
    package = (exc.name or "missing").split(".")[0]
    return ModuleNotFoundError(
        f"{module} needs the {package} package, which the {extra!r} extra installs: "
        f"pip install 'idem-middleware[{extra}]'",
        name=exc.name,
    )


def blip(error: BaseException) -> TypeGuard[StoreError]:
    """Whether sending the statement again may succeed: the store could not be reached, not a
    statement the database refused (a constraint, a trigger), which it would refuse again, nor
    a store that refuses all work (closed, or never opened: StoreClosed)."""
    return isinstance(error, StoreError) and not isinstance(error, StatementRefused | StoreClosed)

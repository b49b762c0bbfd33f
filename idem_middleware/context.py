"""What a handler sees of the idempotent operation it runs in."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import HTTPConnection

from .errors import ConfigurationError, StaleGeneration
from .keys import token_hash as token_hash
from .outcomes import RELEASE_STATUSES as RELEASE_STATUSES
from .outcomes import Outcome as Outcome
from .outcomes import outcome_for_status as outcome_for_status
from .policy import Mode

#: The ASGI scope entry holding the IdempotencyContext of a claimed request.
SCOPE_KEY = "idem_middleware.context"


def _length_prefixed(*parts: str) -> bytes:
    out = bytearray()
    for part in parts:
        raw = part.encode()
        out += len(raw).to_bytes(8, "big") + raw
    return bytes(out)


def derive_downstream_key(tenant: str, operation: str, key: str, epoch: int | None = None) -> str:
    """A stable idempotency key for a third party, the same on every retry of one request.

    Derived from the key space and the record's epoch (its life: see `Record.epoch`), never from
    the generation: a takeover or a reconciliation re-sends the same key and the downstream system
    deduplicates it, while the same key reused after its retention (a new request) sends a new
    one. Without an epoch (a record claimed before the store knew epochs) it is derived from the
    key space only. A transactional claim has an epoch too, its own: one rolled back (a 5xx, a
    409) leaves no record, so its retry claims under another epoch and sends another key (calls
    to third parties, whose effects no rollback undoes, belong in lease mode).
    """
    if not all(isinstance(part, str) for part in (tenant, operation, key)):
        raise TypeError("derive_downstream_key takes the tenant, operation and key as str")
    if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int)):
        # (True derived another key than 1, and "1" the same: one epoch, one key)
        raise TypeError(f"derive_downstream_key: epoch is an int or None, not {epoch!r:.40}")
    if epoch is None:
        digest = hashlib.sha256(b"idem-downstream-1" + _length_prefixed(tenant, operation, key))
    else:
        parts = _length_prefixed(tenant, operation, key, str(epoch))
        digest = hashlib.sha256(b"idem-downstream-2" + parts)
    return digest.hexdigest()


def key_digest(key: str) -> str:
    """A short digest of a raw key for logs: raw keys are never logged above debug level."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass(slots=True, eq=False, kw_only=True, repr=False)
class IdempotencyContext:
    tenant: str
    operation: str
    key: str
    #: The fencing token of this execution.
    generation: int
    mode: Mode
    #: Transactional mode: the connection whose transaction commits with the outcome.
    connection: Any
    #: The record's life (see `Record.epoch`): the downstream key derives from it.
    epoch: int | None = None
    declared: Outcome | None = None
    #: Lease mode: opens (once) the fenced transaction; set by the middleware.
    _fence: Callable[[], Awaitable[Any]] | None = field(default=None, repr=False)
    _lease_lost: asyncio.Event | None = field(default=None, repr=False)
    _downstream_key: str | None = field(default=None, repr=False)
    #: What writes claim sessions still hold (`hold_writes`), flushed before an early settlement.
    _held_writes: list[Callable[[], Awaitable[object]]] | None = field(default=None, repr=False)
    #: Set when the operation's run ends (`leave_context`): from then on `current_context()` no
    #: longer answers with it, in any task (see there).
    _ended: bool = field(default=False, repr=False)
    #: Set when the outcome is recorded before the response ends (a stream's, at its first
    #: byte): `declare` can no longer change it.
    _settled: bool = field(default=False, repr=False)
    #: The ASGI scope of the request it was claimed for (set as it enters it): a task of an
    #: earlier attempt of that request is refused the next attempt's claim (`get_context`).
    _scope: Any = field(default=None, repr=False)

    def __repr__(self) -> str:
        # The raw key may carry personal data (an order or an e-mail): a context logged or shown
        # in a traceback names it by its digest, as the middleware's own logs do.
        return (
            f"IdempotencyContext(tenant={self.tenant!r}, operation={self.operation!r}, "
            f"key_digest={key_digest(self.key)!r}, generation={self.generation!r}, "
            f"mode={self.mode!r}, epoch={self.epoch!r}, declared={self.declared!r})"
        )

    @property
    def downstream_key(self) -> str:
        """The idempotency key to send a third party (see `derive_downstream_key`); derived on
        first use (most handlers never ask)."""
        if self._downstream_key is None:
            self._downstream_key = derive_downstream_key(
                self.tenant, self.operation, self.key, self.epoch
            )
        return self._downstream_key

    async def fenced_connection(self) -> Any:
        """A connection whose transaction commits together with this request's outcome.

        Transactional mode: the claim's own connection. Lease mode: a transaction that locks the
        record under this generation; if the generation is no longer current (the lease was taken
        over), StaleGeneration is raised and nothing written here can commit.
        """
        if self._fence is None:
            return self.connection
        try:
            return await self._fence()
        except StaleGeneration:
            self.lease_lost.set()  # (a heartbeat may not have noticed yet, or never will)
            raise

    def hold_writes(self, flush: Callable[[], Awaitable[object]]) -> Callable[[], None]:
        """Register a session's `flush`, run before the outcome is recorded early (a response
        that streams, or is over the size cap, is settled before its first byte, when a FastAPI
        dependency's end has not committed the session yet). Returns its removal."""
        if self._held_writes is None:
            self._held_writes = []
        held = self._held_writes
        held.append(flush)
        return lambda: held.remove(flush)

    async def flush_held_writes(self) -> None:
        """Before an early settlement: write what the registered sessions still hold, into the
        transaction that commits with the outcome (a failure here fails the request instead)."""
        for flush in list(self._held_writes or ()):
            await flush()

    @property
    def lease_lost(self) -> asyncio.Event:
        """Lease mode: set when this generation was found no longer to hold the claim (by a
        heartbeat, or by a fenced write refused with StaleGeneration)."""
        if self._lease_lost is None:  # made on demand: most requests never look at it
            self._lease_lost = asyncio.Event()
        return self._lease_lost

    @property
    def fencing_token(self) -> int:
        """The generation, for downstream systems that can reject a stale writer."""
        return self.generation

    def declare(self, outcome: Outcome | str) -> None:
        """Decide the outcome explicitly, whatever the response status turns out to be (an
        `Outcome`, or its value: `"release"`)."""
        try:
            outcome = Outcome(outcome)  # (the plain string was compared by identity: "release"
        except ValueError:  # left a lease-mode key unknown, and "bogus" was taken)
            valid = ", ".join(repr(o.value) for o in Outcome)
            raise ConfigurationError(
                f"declare takes an Outcome ({valid}), not {outcome!r}"
            ) from None
        if outcome is Outcome.UNKNOWN and self.mode is Mode.TRANSACTIONAL:
            raise ConfigurationError(
                "a transactional route cannot end unknown: its effects roll back with it"
            )
        if self._settled or self._ended:  # (it was taken, and changed nothing)
            raise RuntimeError(
                "declare came after this operation's outcome was recorded (at the first byte "
                "of a response that streams, or when its run ended): declare before those"
            )
        self.declared = outcome


#: The context of the claim running in this task (`current_context`). Entered and left by
#: `enter_context` and `leave_context`; the transactional attempt, once per request, does the
#: same inline (two calls fewer).
CURRENT: ContextVar[IdempotencyContext | None] = ContextVar("idem_middleware_context", default=None)


def current_context() -> IdempotencyContext | None:
    """The context of the idempotent operation running in this task, if any.

    Lets code far from the request (an HTTP client hook, say) find the downstream key. A task
    the operation started (`asyncio.create_task` copies the context variables) sees it only
    while the operation runs: a worker started lazily by one request, living on, would
    otherwise send that request's downstream key with every later, unrelated call, and the
    third party would take them all for the first one.
    """
    context = CURRENT.get()
    if context is None or context._ended:
        return None
    return context


def claimed_context(
    tenant: str,
    operation: str,
    key: str,
    generation: int,
    mode: Mode,
    connection: Any,
    epoch: int | None,
    fence: Callable[[], Awaitable[Any]] | None = None,
) -> IdempotencyContext:
    """`IdempotencyContext(tenant=..., ...)` for a claim the middleware made (once per request).
    A class called with keywords first packs them into a dict for its `__init__`, and its
    `__init__` is a call of its own: every field is set here as that `__init__` sets it (the
    context is not frozen; a test compares the two, field by field)."""
    context = _new(IdempotencyContext)
    context.tenant = tenant
    context.operation = operation
    context.key = key
    context.generation = generation
    context.mode = mode
    context.connection = connection
    context.epoch = epoch
    context.declared = None
    context._fence = fence
    context._lease_lost = None
    context._downstream_key = None
    context._held_writes = None
    context._ended = False
    context._settled = False
    context._scope = None
    return context


_new = object.__new__


def enter_context(scope: MutableMapping[str, Any], context: IdempotencyContext) -> Token[Any]:
    scope[SCOPE_KEY] = context
    context._scope = scope
    return CURRENT.set(context)


def leave_context(
    scope: MutableMapping[str, Any], token: Token[Any], context: IdempotencyContext
) -> None:
    scope.pop(SCOPE_KEY, None)
    CURRENT.reset(token)
    context._ended = True  # (tasks it started keep it in their copies: see current_context)


def get_context(scope_or_request: HTTPConnection | Mapping[str, Any]) -> IdempotencyContext:
    """The context of the current request (pass the ASGI scope or a Starlette Request).

    Raises LookupError when the request is not running under a claim (an unguarded route, or a
    route whose key is optional and was not sent), or when called from a task an earlier attempt
    of the request started (the request runs again after a conflict: see `IdempotencyContext`).
    """
    scope = getattr(scope_or_request, "scope", scope_or_request)
    if not isinstance(scope, Mapping):  # (None, or a str: an AttributeError from inside)
        raise TypeError(f"get_context takes a request or its scope, not {scope!r:.60}")
    context = scope.get(SCOPE_KEY)
    if context is None:
        raise LookupError("this request is not running under an idempotency claim")
    assert isinstance(context, IdempotencyContext)
    own = CURRENT.get()
    if own is not None and own._scope is scope and own is not context and own._ended:
        # A task an earlier attempt of this very request started, still running after that
        # attempt was rolled back and run again (a serialization failure): the scope holds the
        # new attempt's claim, which is not its own. Its writes there committed with the new
        # attempt's outcome, beside the new attempt's own: the effect twice. (A task another
        # request started, a worker serving later requests, is not refused.)
        raise LookupError(
            "the attempt this task was started in is over (the request runs again under a new "
            "claim): a task of an earlier attempt cannot use the new one's"
        )
    return context

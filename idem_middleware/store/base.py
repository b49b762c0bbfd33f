"""The store protocol the middleware talks to, and the value types that cross it."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, NamedTuple, Protocol, cast

# Defined in errors.py with the library's other exceptions; importable from here as before.
from ..errors import ClaimBusy as ClaimBusy
from ..errors import ClaimTimeout as ClaimTimeout
from ..errors import RetryableConflict as RetryableConflict
from ..errors import StoreError
from ..frozen import quick_init
from ..waiting import wait_at_most


class State(StrEnum):
    PENDING = "pending"
    SUCCEEDED = "succeeded"
    FAILED_FINAL = "failed_final"
    UNKNOWN = "unknown"


FINAL_STATES = frozenset({State.SUCCEEDED, State.FAILED_FINAL})
#: The states of records not finished yet, in `State`'s order (what `stats` counts cheaply).
UNRESOLVED_STATES = (State.PENDING, State.UNKNOWN)


class RecordKey(NamedTuple):
    """The key space: tenant first, so the table can be distributed by tenant.

    A named tuple (immutable, and hashed in C): every request makes one and looks it up several
    times. (Its `__new__` is a Python function; `new_record_key` builds one without it.)"""

    tenant: str
    operation: str
    key: str


#: `new_record_key((tenant, operation, key))` is `RecordKey(tenant, operation, key)` built in C: the
#: named tuple's own `__new__` is a Python function (a frame, and an argument tuple) per request.
new_record_key = cast(
    "Callable[[tuple[str, str, str]], RecordKey]", functools.partial(tuple.__new__, RecordKey)
)


@quick_init  # (built once per request: see frozen.py)
@dataclass(frozen=True, slots=True)
class StoredResponse:
    status: int
    headers: Sequence[tuple[bytes, bytes]]
    body: bytes
    #: Why the body was not kept ("too-large", "streaming"), or None when it was.
    body_omitted: str | None = None


@quick_init
@dataclass(frozen=True, slots=True)
class Record:
    """A key's record as the store last committed it."""

    key: RecordKey
    fingerprint: bytes
    state: State
    generation: int
    response: StoredResponse | None
    #: A final record whose retention is over: it no longer protects anything.
    expired: bool = False
    #: A pending record whose lease has lapsed (lease mode).
    lease_expired: bool = False
    #: A pending record with no executor, released for the client's next retry (lease mode).
    retry_allowed: bool = False
    #: The record's life: set when it is claimed afresh (or reclaimed after its retention), kept
    #: across takeovers. The downstream key derives from it. None for a record claimed before
    #: the store knew epochs (its downstream key is the older one, from the key space only).
    epoch: int | None = None


@quick_init
@dataclass(frozen=True, slots=True)
class Claimed:
    """The caller owns the key under `generation`."""

    generation: int
    #: The claimed record's life (see Record.epoch): a fresh record's is its first generation.
    epoch: int


@quick_init
@dataclass(frozen=True, slots=True)
class Existing:
    """A record holds the key: the caller answers from it (replay, mismatch, in flight)."""

    record: Record


@quick_init
@dataclass(frozen=True, slots=True)
class TokenRefused:
    """The key is not a live token this request may consume; `reason` says why, for the
    client. Nothing was claimed."""

    reason: str


#: What a claim returns. Match on it: each case is one thing the caller does next.
Claim = Claimed | Existing | TokenRefused


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counts per state and the age in seconds of the oldest record in each (None if empty).

    `stats(unresolved_only=True)` counts pending and unknown records alone: `counts` and
    `oldest_age_seconds` then have no succeeded or failed_final entry (not a zero: not counted).
    """

    counts: dict[str, int]
    oldest_age_seconds: dict[str, float | None]
    #: Pending records whose lease lapsed: their executor died or stalled, and nobody has taken
    #: them on yet (the next `reconcile`, or the client's retry).
    lapsed_leases: int = 0

    @property
    def oldest_unresolved_age_seconds(self) -> float | None:
        """The age of the oldest pending or unknown record: the number an alert watches."""
        ages = [
            age
            for state in (State.PENDING.value, State.UNKNOWN.value)
            if (age := self.oldest_age_seconds.get(state)) is not None
        ]
        return max(ages) if ages else None


class TransactionSession(Protocol):
    """One connection, and one transaction that begins with the claim: the claim, the handler's
    writes on `connection`, and the outcome commit together, or none of them does."""

    @property
    def connection(self) -> Any:
        """The driver connection the handler does its business writes on (None for memory)."""

    async def claim(
        self,
        key: RecordKey,
        fingerprint: bytes,
        *,
        retention_seconds: float,
        wait_seconds: float,
        token_hash: bytes | None = None,
    ) -> Claim:
        """Begin the transaction and claim the key in it (one message on PostgreSQL).

        `Claimed`: the key is held by this transaction until it finishes or abandons.
        `Existing`: a record holds the key, and the transaction is over (nothing to abandon).
        `TokenRefused`: with `token_hash`, the key is not a live token this request may
        consume; nothing claimed.

        A lease-mode record of the same request (its route moved to transactional mode) is no
        dead end: one released for a retry is claimed (taken over by this transaction, and
        released again if it rolls back); one whose lease lapsed (`lapsed`) is returned
        `unknown`, marked so after the transaction ended, unless another session holds its row.

        Never waits for a concurrent claim: raises ClaimBusy at once (the transaction is rolled
        back: the caller waits without its connection, then claims in a new transaction);
        `wait_seconds` only bounds the statements. Raises RetryableConflict when the database
        refused the transaction (serialization failure, deadlock): run it again.
        """

    async def finish(self, state: State, response: StoredResponse) -> None:
        """Record the outcome of the claim this transaction made, and commit it with the
        handler's writes (PostgreSQL: one message). RetryableConflict: nothing committed, run it
        again."""

    async def abandon(self) -> None:
        """Roll back: the handler's writes are undone and the key is free again."""

    async def release(self) -> None:
        """End the session now (abandoning anything still open) and give its connection back:
        a response streams on without one. Leaving the `transaction()` block then does nothing."""

    def conflict(self, exc: BaseException) -> bool:
        """Whether `exc`, raised by the handler's writes on `connection`, is the database
        refusing the transaction (serialization failure, deadlock): running it again may pass."""

    def lost(self) -> StoreError | None:
        """After the handler raised: the error to answer with when `connection` is gone (the
        server ended the session, the network dropped it, the handler gave it back), and so
        nothing of the attempt committed; None while it is there."""


def lapsed(record: Record, fingerprint: bytes) -> bool:
    """A pending record of this request whose lease lapsed, as a transactional claim finds it:
    the lease-mode executor died (its route moved to transactional mode since, say). Nothing
    runs it, and a transactional request cannot take it over (its effect may have happened
    elsewhere), so the claim marks it `unknown`, as a lease-mode retry or `reconcile` would."""
    pending = record.state is State.PENDING
    return pending and record.lease_expired and record.fingerprint == fingerprint


@dataclass(frozen=True, slots=True)
class Settlement:
    """An outcome to record: a final state with its response, unknown, or a release."""

    state: State
    response: StoredResponse | None = None
    note: str | None = None


@dataclass(frozen=True, slots=True)
class RecordSummary:
    """A record as an operator lists it (no stored body)."""

    key: RecordKey
    state: State
    generation: int
    mode: str
    created_at: Any
    updated_at: Any
    lease_expires_at: Any
    expires_at: Any
    response_status: int | None
    note: str | None
    lease_expired: bool
    #: See Record.epoch.
    epoch: int | None = None
    #: An operator reopened it from an outcome (`reopen`), and nobody has moved it since.
    reopened: bool = False

    @property
    def by_hand(self) -> bool:
        """Only an operator settles it: writes may have committed with its outcome (see
        `reopened`; a transactional one's always did), which a `Happened` would repeat."""
        return self.mode != "lease" or self.reopened


class Watch(Protocol):
    async def wait(self, seconds: float) -> bool:
        """Wait for a change notification; False after `seconds` (or if nothing can notify)."""


class EventWatch:
    """A Watch over an asyncio.Event that the store sets when the record may have changed.

    `listening` says whether anything can set it now (False: PostgreSQL's LISTEN is unavailable,
    or still connecting, and the waiter polls); pass a callable when that can change.
    """

    __slots__ = ("_event", "_listening")

    def __init__(self, event: asyncio.Event, listening: bool | Callable[[], bool] = True) -> None:
        self._event = event
        self._listening = listening

    @property
    def listening(self) -> bool:
        listening = self._listening
        return listening() if callable(listening) else listening

    async def wait(self, seconds: float) -> bool:
        event = self._event
        await wait_at_most(event, max(seconds, 0.0))  # (not `wait_for`: see there)
        if not event.is_set():
            return False
        event.clear()
        return True


class FencedSession(Protocol):
    """A transaction that holds the record's row lock under the executor's generation.

    The handler's business writes go on `connection`; the settlement commits with them, or
    neither does. Opening it fails with StaleGeneration if the generation is no longer current.
    """

    @property
    def connection(self) -> Any: ...

    async def settle(self, s: Settlement) -> bool:
        """Record the outcome as the session's last act, and commit it with the writes made on
        `connection` (PostgreSQL: one message). False, and nothing committed, if the generation
        is no longer current."""


@dataclass(frozen=True, slots=True)
class TokenRow:
    """The token an intent holds after `issue_token` (see queries.sql `issue_token`): `spent`
    when it was consumed and has expired (never renewed then)."""

    token_hash: bytes
    expires_at: datetime
    request_digest: bytes | None
    spent: bool


class Store(Protocol):
    """What the middleware needs of a store. The PostgreSQL store is the real one."""

    # (pyright reads the context manager's `async def __aexit__` as returning a
    # `types.CoroutineType`: a plain `def` one must be annotated so, as PgTransaction's is.)
    def transaction(
        self, *, acquire_timeout: float
    ) -> AbstractAsyncContextManager[TransactionSession]:
        """Acquire a connection for a claim's transaction (its claim begins it); leaving the
        block abandons whatever did not finish, and gives the connection back."""

    async def get(self, key: RecordKey) -> Record | None:
        """The committed record, if any."""

    async def peek(self, key: RecordKey) -> tuple[Record | None, bool | None]:
        """The status resource's read: the committed record (as `get`), and, when there is no
        live one, whether a transaction is claiming the key now (its claim is uncommitted);
        None when the store cannot tell (PostgreSQL: its role may not read pg_locks)."""

    # -- lease mode: every call commits on its own -----------------------------------------------

    async def claim_lease(
        self,
        key: RecordKey,
        fingerprint: bytes,
        *,
        retention_seconds: float,
        lease_seconds: float,
        token_hash: bytes | None = None,
    ) -> Claim:
        """Commit a pending claim with a lease (`Claimed`), or return the record that holds the
        key as last committed (`Existing`), or why the token was refused (`TokenRefused`).

        Never waits for a transaction claiming the key (a transactional claim, which holds it
        until it ends): raises ClaimBusy at once, and the caller waits without a connection,
        then claims again."""

    async def heartbeat(self, key: RecordKey, generation: int, lease_seconds: float) -> bool:
        """Renew the lease; False if this generation no longer holds a pending claim. Never
        waits for the record's row lock: while a fenced session holds it (the executor's own),
        the record is answered from its last committed version and left as it is."""

    async def expire_lease(self, key: RecordKey, generation: int) -> bool:
        """pending with a lapsed lease -> unknown; False if that is not the record's state."""

    async def takeover(
        self, key: RecordKey, generation: int, expected: State, lease_seconds: float
    ) -> int | None:
        """Become the executor under a new generation (see queries.sql `takeover`); None when
        the record is no longer `expected` under `generation`. Never waits for the record's row:
        while another session holds it (a fenced transaction, a transaction taking a released
        record over) raises ClaimBusy at once, and the caller waits without a connection, then
        looks again."""

    async def settle(self, key: RecordKey, generation: int, expected: State, s: Settlement) -> bool:
        """Move the record from `expected` under `generation` to the settlement; wake waiters."""

    async def release(self, key: RecordKey, generation: int) -> bool:
        """Delete a pending claim whose request did nothing; wake waiters."""

    async def allow_retry(self, key: RecordKey, generation: int, note: str) -> bool:
        """unknown -> pending without a lease, lease mode only (a transactional record committed
        its handler's writes with its outcome): the client's next retry takes it over. False when
        nothing moved."""

    async def amend(self, key: RecordKey, generation: int, expected: State, s: Settlement) -> bool:
        """An operator's move from `expected` under `generation`: like `settle`, but `s.note` is
        appended to the record's audit trail (stamped with the store's time), and a move to
        pending releases the record for the client's next retry under a new generation."""

    async def describe(self, key: RecordKey) -> RecordSummary | None:
        """One record as an operator lists it, with its audit trail."""

    def fenced(
        self, key: RecordKey, generation: int, expected: State = State.PENDING
    ) -> AbstractAsyncContextManager[FencedSession]:
        """A fenced transaction (see FencedSession); commits on a clean exit."""

    def watch(self, key: RecordKey) -> AbstractAsyncContextManager[Watch]:
        """Listen for changes of one record; enter it *before* reading the record."""

    async def list_records(
        self,
        *,
        states: Sequence[State],
        tenant: str | None = None,
        operation: str | None = None,
        limit: int = 100,
        stale_only: bool = False,
    ) -> list[RecordSummary]: ...

    async def mark_asked(self, key: RecordKey, generation: int) -> bool:
        """`reconcile` asked about the record, unknown under `generation`, and left it so: it
        is listed after the unknown records not asked since they went unknown (see queries.sql
        `list_records`). False if not stamped (moved, or held by another session)."""

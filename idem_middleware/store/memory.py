"""An in-memory twin of the PostgreSQL store, for unit tests and for trying the middleware out.

It copies the database's semantics, not just its API: a claim is invisible to others until its
transaction commits, a concurrent claim on the same key waits for that commit or rollback (as
PostgreSQL's INSERT waits on the conflicting row), generations come from one counter and are never
reused, and expiry is judged by the store's clock. The same contract suite runs on both stores.
It holds nothing across processes and loses everything on exit: never use it in production.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from ..errors import StaleGeneration, StoreError
from ..keys import token_hash
from .base import (
    Claim,
    ClaimBusy,
    EventWatch,
    Record,
    RecordKey,
    RecordSummary,
    Settlement,
    State,
    StoredResponse,
)


@dataclass(frozen=True, slots=True)
class _Token:
    operation: str
    request_digest: bytes | None
    expires_at: float
    consumed: bool = False


@dataclass(frozen=True, slots=True)
class _Row:
    fingerprint: bytes
    state: State
    generation: int
    retention: float
    expires_at: float | None = None
    response: StoredResponse | None = None
    mode: str = "transactional"
    lease_expires_at: float | None = None
    created_at: float = 0.0
    updated_at: float = 0.0
    note: str | None = None
    #: The record's life (see Record.epoch): its first generation, kept across takeovers.
    epoch: int | None = None

    def record(self, key: RecordKey, now: float) -> Record:
        return Record(
            key=key,
            fingerprint=self.fingerprint,
            state=self.state,
            generation=self.generation,
            response=self.response,
            expired=self.expires_at is not None and self.expires_at <= now,
            lease_expired=self.lease_expires_at is not None and self.lease_expires_at <= now,
            retry_allowed=(
                self.state is State.PENDING
                and self.mode == "lease"
                and self.lease_expires_at is None
            ),
            epoch=self.epoch,
        )


def _summary(key: RecordKey, row: _Row, now: float) -> RecordSummary:
    return RecordSummary(
        key=key,
        state=row.state,
        generation=row.generation,
        mode=row.mode,
        created_at=row.created_at,
        updated_at=row.updated_at,
        lease_expires_at=row.lease_expires_at,
        expires_at=row.expires_at,
        response_status=None if row.response is None else row.response.status,
        note=row.note,
        lease_expired=row.lease_expires_at is not None and row.lease_expires_at <= now,
        epoch=row.epoch,
    )


class _MemoryTransaction:
    def __init__(self, store: MemoryStore) -> None:
        self._store = store
        self._staged: dict[RecordKey, _Row] = {}
        self._held: dict[RecordKey, asyncio.Event] = {}
        #: Tokens this transaction's claims consume, marked at commit.
        self._consumed: set[tuple[str, bytes]] = set()
        self.active = False

    @property
    def connection(self) -> None:
        return None

    async def begin(self) -> None:
        self.active = True

    async def commit(self) -> None:
        self._store._rows.update(self._staged)
        for token in self._consumed:
            self._store._consume(token, True)
        self._finish()

    async def rollback(self) -> None:
        self._finish()

    async def release(self) -> None:
        if self.active:
            self._finish()

    def _finish(self) -> None:
        self._staged.clear()
        self._consumed.clear()
        for key, event in self._held.items():
            del self._store._owners[key]
            event.set()
        self._held.clear()
        self.active = False

    def _own(self, key: RecordKey, row: _Row) -> Claim:
        event = asyncio.Event()
        self._store._owners[key] = event
        self._held[key] = event
        self._staged[key] = row
        return Claim(True, row.generation, None, row.epoch)

    async def claim(
        self,
        key: RecordKey,
        fingerprint: bytes,
        *,
        retention_seconds: float,
        wait_seconds: float,
        token_hash: bytes | None = None,
    ) -> Claim:
        if not self.active:
            await self.begin()  # opened with begin=False: the claim starts the transaction
        store = self._store
        now = store.clock()
        generation = next(store._generations)
        fresh = _Row(
            fingerprint,
            State.PENDING,
            generation,
            retention_seconds,
            created_at=now,
            updated_at=now,
            epoch=generation,
        )
        current = self._staged.get(key) or store._rows.get(key)
        record = None if current is None else current.record(key, store.clock())
        if record is not None and not record.expired:
            return Claim(False, record.generation, record)  # a replay: no wait, no lock
        if key in store._owners and key not in self._held:
            # Another transaction is claiming it: never wait here (see ClaimBusy).
            raise ClaimBusy("another transaction is claiming this key")
        if record is None or record.expired:
            if token_hash is not None:
                if store._token_problem(key, token_hash, fingerprint):
                    return Claim(False, 0, None)
                self._consumed.add((key.tenant, token_hash))
            return self._own(key, fresh)
        return Claim(False, record.generation, record)

    async def complete(
        self, key: RecordKey, generation: int, state: State, response: StoredResponse
    ) -> None:
        row = self._staged.get(key)
        if row is None or row.generation != generation or row.state is not State.PENDING:
            raise StoreError("completion matched no pending record")
        now = self._store.clock()
        self._staged[key] = replace(
            row, state=state, response=response, expires_at=now + row.retention, updated_at=now
        )

    async def complete_and_commit(
        self, key: RecordKey, generation: int, state: State, response: StoredResponse
    ) -> None:
        await self.complete(key, generation, state, response)
        await self.commit()


class _MemoryFenced:
    """Settlements made in a fenced session apply when it ends cleanly, as a commit would."""

    def __init__(self, store: MemoryStore) -> None:
        self._store = store
        self.pending: list[tuple[RecordKey, int, State, Settlement]] = []

    @property
    def connection(self) -> None:
        return None

    async def settle(self, key: RecordKey, generation: int, expected: State, s: Settlement) -> bool:
        if self._store._current(key, generation, expected) is None:
            return False
        self.pending.append((key, generation, expected, s))
        return True

    async def settle_and_commit(
        self, key: RecordKey, generation: int, expected: State, s: Settlement
    ) -> bool:
        return await self.settle(key, generation, expected, s)  # applied when the session ends


class MemoryStore:
    """See the module docstring. `clock` is the store's notion of the database's `now()`."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._rows: dict[RecordKey, _Row] = {}
        self._owners: dict[RecordKey, asyncio.Event] = {}
        self._generations = itertools.count(1)
        self._watchers: dict[RecordKey, set[asyncio.Event]] = {}
        self._fence_locks: dict[RecordKey, asyncio.Lock] = {}
        self._tokens: dict[tuple[str, bytes], _Token] = {}

    @asynccontextmanager
    async def transaction(
        self, *, acquire_timeout: float, begin: bool = True
    ) -> AsyncIterator[_MemoryTransaction]:
        session = _MemoryTransaction(self)
        if begin:
            await session.begin()
        try:
            yield session
        finally:
            if session.active:
                await session.rollback()

    async def get(self, key: RecordKey) -> Record | None:
        row = self._rows.get(key)
        return None if row is None else row.record(key, self.clock())

    async def open(self) -> MemoryStore:
        return self

    # -- one-time tokens -------------------------------------------------------------------------

    def add_token(
        self,
        tenant: str,
        token_hash: bytes,
        operation: str,
        *,
        ttl_seconds: float,
        request_digest: bytes | None = None,
    ) -> None:
        """Record an issued token (the PostgreSQL store's TokenIssuer does this in SQL)."""
        expires_at = self.clock() + ttl_seconds
        self._tokens[(tenant, token_hash)] = _Token(operation, request_digest, expires_at)

    def _token_problem(self, key: RecordKey, token_hash: bytes, fingerprint: bytes) -> str:
        token = self._tokens.get((key.tenant, token_hash))
        if token is None:
            return "This key is not a token issued to you for this operation."
        if token.operation != key.operation:
            return "This token was issued for another operation."
        if token.consumed:
            return "This token was already used; ask for a new one."
        if token.expires_at <= self.clock():
            return "This token has expired; ask for a new one."
        if token.request_digest is not None and token.request_digest != fingerprint:
            return "This token was issued for a different request."
        return ""

    def _consume(self, token: tuple[str, bytes], consumed: bool) -> None:
        found = self._tokens.get(token)
        if found is not None:
            self._tokens[token] = replace(found, consumed=consumed)

    async def token_problem(self, key: RecordKey, token_hash: bytes, fingerprint: bytes) -> str:
        return self._token_problem(key, token_hash, fingerprint)

    # -- lease mode ------------------------------------------------------------------------------

    def _current(self, key: RecordKey, generation: int, state: State) -> _Row | None:
        """The committed row, if it is in `state` under `generation`."""
        row = self._rows.get(key)
        if row is None or row.generation != generation or row.state is not state:
            return None
        return row

    def _row_lock(self, key: RecordKey) -> asyncio.Lock:
        """The record's row lock: a fenced session holds it, and every write to the record waits
        for it, as an UPDATE or DELETE waits on PostgreSQL's `SELECT ... FOR UPDATE`."""
        return self._fence_locks.setdefault(key, asyncio.Lock())

    def _changed(self, key: RecordKey) -> None:
        for event in self._watchers.get(key, ()):
            event.set()

    async def claim_lease(
        self,
        key: RecordKey,
        fingerprint: bytes,
        *,
        retention_seconds: float,
        lease_seconds: float,
        token_hash: bytes | None = None,
    ) -> Claim:
        # A transaction still holding the key (a transactional claim) is waited for, as the
        # INSERT would wait on PostgreSQL; lease claims themselves commit at once.
        owner = self._owners.get(key)
        if owner is not None:
            await owner.wait()
        now = self.clock()
        row = self._rows.get(key)
        if row is not None:
            record = row.record(key, now)
            if not record.expired:
                return Claim(False, row.generation, record)
        if token_hash is not None:
            if self._token_problem(key, token_hash, fingerprint):
                return Claim(False, 0, None)
            self._consume((key.tenant, token_hash), True)
        generation = next(self._generations)
        fresh = _Row(
            fingerprint,
            State.PENDING,
            generation,
            retention_seconds,
            mode="lease",
            lease_expires_at=now + lease_seconds,
            created_at=now,
            updated_at=now,
            epoch=generation,
        )
        self._rows[key] = fresh
        return Claim(True, fresh.generation, None, fresh.epoch)

    async def heartbeat(self, key: RecordKey, generation: int, lease_seconds: float) -> bool:
        async with self._row_lock(key):
            row = self._current(key, generation, State.PENDING)
            if row is None:
                return False
            self._rows[key] = replace(row, lease_expires_at=self.clock() + lease_seconds)
            return True

    async def expire_lease(self, key: RecordKey, generation: int) -> bool:
        async with self._row_lock(key):
            row = self._current(key, generation, State.PENDING)
            now = self.clock()
            if row is None or row.lease_expires_at is None or row.lease_expires_at > now:
                return False
            self._rows[key] = replace(
                row,
                state=State.UNKNOWN,
                lease_expires_at=None,
                updated_at=now,
                note="lease expired",
            )
            self._changed(key)
            return True

    async def takeover(
        self, key: RecordKey, generation: int, expected: State, lease_seconds: float
    ) -> int | None:
        if expected not in (State.PENDING, State.UNKNOWN):
            # A finished outcome is replayed, never run again (PROTOCOL §2).
            raise ValueError(f"only a pending or unknown record can be taken over, not {expected}")
        async with self._row_lock(key):
            row = self._current(key, generation, expected)
            now = self.clock()
            if row is None:
                return None
            if expected is State.PENDING and (
                row.lease_expires_at is not None and row.lease_expires_at > now
            ):
                return None
            new = next(self._generations)
            self._rows[key] = replace(
                row,
                state=State.PENDING,
                generation=new,
                lease_expires_at=now + lease_seconds,
                updated_at=now,
            )
            return new

    def _settle_now(self, key: RecordKey, generation: int, expected: State, s: Settlement) -> bool:
        row = self._current(key, generation, expected)
        if row is None:
            return False
        now = self.clock()
        final = s.state in (State.SUCCEEDED, State.FAILED_FINAL)
        self._rows[key] = replace(
            row,
            state=s.state,
            response=s.response,
            expires_at=now + row.retention if final else None,
            lease_expires_at=None,
            updated_at=now,
            note=s.note if s.note is not None else row.note,
        )
        self._changed(key)
        return True

    async def settle(self, key: RecordKey, generation: int, expected: State, s: Settlement) -> bool:
        async with self._row_lock(key):
            return self._settle_now(key, generation, expected, s)

    async def release(self, key: RecordKey, generation: int) -> bool:
        async with self._row_lock(key):
            if self._current(key, generation, State.PENDING) is None:
                return False
            del self._rows[key]
            # A token the claim consumed is unused again: nothing happened.
            token = (key.tenant, token_hash(key.key))
            found = self._tokens.get(token)
            if found is not None and found.operation == key.operation:
                self._consume(token, False)
            self._changed(key)
            return True

    async def allow_retry(self, key: RecordKey, generation: int, note: str) -> bool:
        async with self._row_lock(key):
            row = self._current(key, generation, State.UNKNOWN)
            if row is None:
                return False
            self._rows[key] = replace(
                row,
                state=State.PENDING,
                generation=next(self._generations),
                lease_expires_at=None,
                updated_at=self.clock(),
                note=note,
            )
            self._changed(key)
            return True

    async def amend(self, key: RecordKey, generation: int, expected: State, s: Settlement) -> bool:
        async with self._row_lock(key):
            row = self._current(key, generation, expected)
            if row is None:
                return False
            # The clock decides expiry; the audit trail shows wall time, as PostgreSQL's now().
            stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            line = f"{stamp} {s.note or ''}"
            self._settle_now(key, generation, expected, replace(s, note=None))
            row = self._rows[key]
            if s.state is State.PENDING:
                row = replace(row, generation=next(self._generations))
            self._rows[key] = replace(row, note=line if row.note is None else f"{row.note}\n{line}")
            return True

    async def describe(self, key: RecordKey) -> RecordSummary | None:
        row = self._rows.get(key)
        return None if row is None else _summary(key, row, self.clock())

    @asynccontextmanager
    async def fenced(
        self, key: RecordKey, generation: int, expected: State = State.PENDING
    ) -> AsyncIterator[_MemoryFenced]:
        # The row lock of the fenced transaction: one fenced session per key at a time.
        async with self._row_lock(key):
            if self._current(key, generation, expected) is None:
                raise StaleGeneration(
                    f"generation {generation} no longer holds the record; its writes are refused"
                )
            session = _MemoryFenced(self)
            yield session
            for args in session.pending:
                self._settle_now(*args)

    @asynccontextmanager
    async def watch(self, key: RecordKey) -> AsyncIterator[EventWatch]:
        event = asyncio.Event()
        self._watchers.setdefault(key, set()).add(event)
        try:
            yield EventWatch(event)
        finally:
            self._watchers[key].discard(event)
            if not self._watchers[key]:
                del self._watchers[key]

    async def list_records(
        self,
        *,
        states: Sequence[State],
        tenant: str | None = None,
        operation: str | None = None,
        limit: int = 100,
        stale_only: bool = False,
    ) -> list[RecordSummary]:
        now = self.clock()
        found = []
        for key, row in self._rows.items():
            if row.state not in states or tenant not in (None, key.tenant):
                continue
            if operation not in (None, key.operation):
                continue
            lapsed = row.lease_expires_at is None or row.lease_expires_at <= now
            if stale_only and row.state is State.PENDING and not lapsed:
                continue
            found.append(_summary(key, row, now))
        found.sort(key=lambda r: r.updated_at)
        return found[:limit]

    async def purge(self, *, batch_size: int = 1000, max_batches: int = 1000) -> int:
        now = self.clock()
        doomed = [
            key
            for key, row in self._rows.items()
            if row.expires_at is not None and row.expires_at <= now and key not in self._owners
        ][: batch_size * max_batches]
        for key in doomed:
            del self._rows[key]
        # This store's tokens carry no intent, so none needs a tombstone once it has expired
        # (see queries.sql `purge_tokens`): an expired token is refused, a deleted one too.
        for token, found in list(self._tokens.items()):
            if found.expires_at <= now:
                del self._tokens[token]
        return len(doomed)

    async def close(self) -> None:
        return None

    async def __aenter__(self) -> MemoryStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

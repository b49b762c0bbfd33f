"""`MemoryStore`: its lifecycle and the operations that commit on their own (lease mode).

See the package's docstring for what the twin copies from PostgreSQL.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import replace

from ...errors import ClaimBusy, StaleGeneration
from ...keys import token_hash
from ..base import (
    Claim,
    Claimed,
    EventWatch,
    Existing,
    Record,
    RecordKey,
    Settlement,
    State,
    TokenRefused,
)
from .edges import OffPathOperations
from .sessions import _MemoryFenced, _MemoryTransaction
from .tables import _Row, appended


class MemoryStore(OffPathOperations):
    """See the package's docstring. `clock` is the store's notion of the database's `now()`."""

    def transaction(
        self, *, acquire_timeout: float
    ) -> AbstractAsyncContextManager[_MemoryTransaction]:
        # The session is its own context manager: no generator per request.
        return _MemoryTransaction(self)

    async def get(self, key: RecordKey) -> Record | None:
        row = self._rows.get(key)
        return None if row is None else row.record(key, self.clock())

    async def open(self) -> MemoryStore:
        return self

    # -- lease mode ------------------------------------------------------------------------------

    async def claim_lease(
        self,
        key: RecordKey,
        fingerprint: bytes,
        *,
        retention_seconds: float,
        lease_seconds: float,
        token_hash: bytes | None = None,
    ) -> Claim:
        now = self.clock()
        row = self._rows.get(key)
        if row is not None:
            record = row.record(key, now)
            if not record.expired:
                return Existing(record)  # (as last committed, whoever is claiming it)
        busy = key in self._owners
        if busy and (row is None or token_hash is None):
            # A transaction is claiming the key: busy, never waited for (PostgreSQL's claim
            # finds its claim lock or its row held); the caller waits without a connection.
            raise ClaimBusy("a transaction is claiming this key")
        if token_hash is not None:
            reason = self._token_problem(key, token_hash, fingerprint)
            if reason:
                return TokenRefused(reason)
            if busy:
                # An expired record a transaction is reclaiming: its token is judged first, as
                # PostgreSQL's claim judges it before it tries the record's row.
                raise ClaimBusy("a transaction is claiming this key")
        generation = next(self._generations)
        if token_hash is not None:
            self._consume((key.tenant, token_hash), generation)
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
        return Claimed(generation, generation)  # a fresh record: its epoch

    async def heartbeat(self, key: RecordKey, generation: int, lease_seconds: float) -> bool:
        held = self._fence_locks.get(key)
        if held is not None and held.locked():
            # Never waited for (queries.sql `heartbeat`): the executor's own fenced session
            # holds it while its handler runs, and nobody can change the record meanwhile.
            return self._current(key, generation, State.PENDING) is not None
        async with self._row_lock(key):
            row = self._current(key, generation, State.PENDING)
            if row is None:
                return False
            # (never shortened: queries.sql `heartbeat`)
            until = self.clock() + lease_seconds
            if row.lease_expires_at is not None and row.lease_expires_at > until:
                until = row.lease_expires_at
            self._rows[key] = replace(row, lease_expires_at=until)
            return True

    async def expire_lease(self, key: RecordKey, generation: int) -> bool:
        # The match first, then the lock: PostgreSQL locks only a row its statement matches, so
        # a record under another generation, or whose lease has not lapsed, is False at once,
        # whoever holds its row.
        if self._lapsed_lease(key, generation) is None:
            return False
        if key in self._fence_locks:
            # Another session holds the record's row (an executor's fenced session past its
            # lease): busy, never waited for, as PostgreSQL's NOWAIT.
            raise ClaimBusy("another session holds the record")
        async with self._row_lock(key):
            row = self._lapsed_lease(key, generation)
            now = self.clock()
            if row is None:
                return False
            self._rows[key] = replace(
                row,
                state=State.UNKNOWN,
                lease_expires_at=None,
                updated_at=now,
                note=appended(row.note, "lease expired"),
            )
            self._changed(key)
            return True

    async def takeover(
        self, key: RecordKey, generation: int, expected: State, lease_seconds: float
    ) -> int | None:
        if expected not in (State.PENDING, State.UNKNOWN):
            # A finished outcome is replayed, never run again.
            raise ValueError(f"only a pending or unknown record can be taken over, not {expected}")
        if self._takeable(key, generation, expected) is None:
            return None  # (the match first, as `expire_lease`'s)
        if key in self._owners or key in self._fence_locks:
            # Another session holds the record's row (a fenced session, a transaction taking a
            # released record over): busy, never waited for, as PostgreSQL's NOWAIT.
            raise ClaimBusy("another session holds the record")
        async with self._row_lock(key):
            row = self._takeable(key, generation, expected)
            now = self.clock()
            if row is None:
                return None
            new = next(self._generations)
            self._rows[key] = replace(
                row,
                state=State.PENDING,
                mode="lease",
                generation=new,
                lease_expires_at=now + lease_seconds,
                updated_at=now,
                note=(
                    appended(row.note, "reconciled unknown -> pending: not happened")
                    if row.state is State.UNKNOWN
                    else row.note
                ),
            )
            return new

    async def settle(self, key: RecordKey, generation: int, expected: State, s: Settlement) -> bool:
        if key in self._fence_locks and self._current(key, generation, expected) is None:
            return False  # a row it does not match is never waited for (see `expire_lease`)
        async with self._row_lock(key):
            return self._settle_now(key, generation, expected, s)

    async def release(self, key: RecordKey, generation: int) -> bool:
        if key in self._fence_locks and self._current(key, generation, State.PENDING) is None:
            return False  # (as `settle`)
        async with self._row_lock(key):
            row = self._current(key, generation, State.PENDING)
            if row is None:
                return False
            del self._rows[key]
            # A token this life's claim consumed is unused again: nothing happened. (Not one a
            # life begun with it as a plain key holds: queries.sql `release`.)
            token = (key.tenant, token_hash(key.key))
            found = self._tokens.get(token)
            if (
                found is not None
                and found.operation == key.operation
                and found.consumed_by is not None
                and found.consumed_by == row.epoch
            ):
                self._consume(token, None)
            self._changed(key)
            return True

    async def allow_retry(self, key: RecordKey, generation: int, note: str) -> bool:
        if self._retryable(key, generation) is None:
            return False  # (as `settle`)
        async with self._row_lock(key):
            row = self._retryable(key, generation)
            if row is None:
                return False
            self._rows[key] = replace(
                row,
                state=State.PENDING,
                generation=next(self._generations),
                lease_expires_at=None,
                updated_at=self.clock(),
                note=appended(row.note, note),
            )
            self._changed(key)
            return True

    @asynccontextmanager
    async def fenced(
        self, key: RecordKey, generation: int, expected: State = State.PENDING
    ) -> AsyncIterator[_MemoryFenced]:
        # The row lock of the fenced transaction: one fenced session per key at a time. A
        # reconciler's (an unknown record's) never waits for another's, as PostgreSQL's
        # `fence_nowait`: busy at once. A record under another generation is stale at once,
        # whoever holds its row (the match first, as `expire_lease`'s).
        if key in self._fence_locks:
            if self._current(key, generation, expected) is None:
                raise _stale(generation)
            if expected is State.UNKNOWN:
                raise ClaimBusy("another session holds the record")
        async with self._row_lock(key):
            if self._current(key, generation, expected) is None:
                raise _stale(generation)
            yield _MemoryFenced(self, key, generation, expected)

    def _lapsed_lease(self, key: RecordKey, generation: int) -> _Row | None:
        """The row `expire_lease` moves: pending under `generation`, its lease lapsed."""
        row = self._current(key, generation, State.PENDING)
        if row is None or row.lease_expires_at is None or row.lease_expires_at > self.clock():
            return None
        return row

    def _takeable(self, key: RecordKey, generation: int, expected: State) -> _Row | None:
        """The row `takeover` moves (its `locked` rows in queries.sql)."""
        row = self._current(key, generation, expected)
        if row is None or (expected is State.UNKNOWN and row.mode != "lease"):
            return None  # (a reopened transactional record: its writes committed)
        lease = row.lease_expires_at
        if expected is State.PENDING and lease is not None and lease > self.clock():
            return None
        return row

    def _retryable(self, key: RecordKey, generation: int) -> _Row | None:
        """The row `allow_retry` moves: unknown under `generation`, lease mode only (as on
        PostgreSQL)."""
        row = self._current(key, generation, State.UNKNOWN)
        return None if row is None or row.mode != "lease" else row

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

    async def close(self) -> None:
        return None

    async def __aenter__(self) -> MemoryStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None


def _stale(generation: int) -> StaleGeneration:
    return StaleGeneration(
        f"generation {generation} no longer holds the record; its writes are refused"
    )

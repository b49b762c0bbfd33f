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
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

from ..errors import StoreError
from .base import Claim, ClaimTimeout, Record, RecordKey, State, StoredResponse


@dataclass(frozen=True, slots=True)
class _Row:
    fingerprint: bytes
    state: State
    generation: int
    retention: float
    expires_at: float | None = None
    response: StoredResponse | None = None

    def record(self, key: RecordKey, now: float) -> Record:
        return Record(
            key=key,
            fingerprint=self.fingerprint,
            state=self.state,
            generation=self.generation,
            response=self.response,
            expired=self.expires_at is not None and self.expires_at <= now,
        )


class _MemoryTransaction:
    def __init__(self, store: MemoryStore) -> None:
        self._store = store
        self._staged: dict[RecordKey, _Row] = {}
        self._held: dict[RecordKey, asyncio.Event] = {}
        self.active = False

    @property
    def connection(self) -> None:
        return None

    async def begin(self) -> None:
        self.active = True

    async def commit(self) -> None:
        self._store._rows.update(self._staged)
        self._finish()

    async def rollback(self) -> None:
        self._finish()

    def _finish(self) -> None:
        self._staged.clear()
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
        return Claim(True, row.generation, None)

    async def claim(
        self,
        key: RecordKey,
        fingerprint: bytes,
        *,
        retention_seconds: float,
        wait_seconds: float,
    ) -> Claim:
        if not self.active:
            raise StoreError("no transaction")
        store = self._store
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_seconds
        while True:
            owner = store._owners.get(key)
            if owner is None or key in self._held:
                break
            remaining = deadline - loop.time()
            try:
                if remaining <= 0:
                    raise TimeoutError
                await asyncio.wait_for(owner.wait(), remaining)
            except TimeoutError:
                raise ClaimTimeout("waited too long for a concurrent claim") from None
        fresh = _Row(fingerprint, State.PENDING, next(store._generations), retention_seconds)
        current = self._staged.get(key) or store._rows.get(key)
        if current is None:
            return self._own(key, fresh)
        record = current.record(key, store.clock())
        if record.expired:
            return self._own(key, fresh)
        return Claim(False, record.generation, record)

    async def complete(
        self, key: RecordKey, generation: int, state: State, response: StoredResponse
    ) -> None:
        row = self._staged.get(key)
        if row is None or row.generation != generation or row.state is not State.PENDING:
            raise StoreError("completion matched no pending record")
        self._staged[key] = replace(
            row,
            state=state,
            response=response,
            expires_at=self._store.clock() + row.retention,
        )


class MemoryStore:
    """See the module docstring. `clock` is the store's notion of the database's `now()`."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._rows: dict[RecordKey, _Row] = {}
        self._owners: dict[RecordKey, asyncio.Event] = {}
        self._generations = itertools.count(1)

    @asynccontextmanager
    async def transaction(self, *, acquire_timeout: float) -> AsyncIterator[_MemoryTransaction]:
        session = _MemoryTransaction(self)
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

    async def close(self) -> None:
        return None

"""The sessions the in-memory store hands out: a transaction that claims and completes, and a
fenced session whose settlements apply when it ends cleanly, as a commit would."""

from __future__ import annotations

import asyncio

from ...errors import StoreError
from ..base import Claim, ClaimBusy, RecordKey, Settlement, State, StoredResponse
from .tables import MemoryTables, _Row


class _MemoryTransaction:
    def __init__(self, store: MemoryTables, *, begin: bool = True) -> None:
        self._store = store
        self._staged: dict[RecordKey, _Row] = {}
        self._held: dict[RecordKey, asyncio.Event] = {}
        #: Tokens this transaction's claims consume, marked at commit.
        self._consumed: set[tuple[str, bytes]] = set()
        self.active = begin

    async def __aenter__(self) -> _MemoryTransaction:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.active:
            await self.rollback()

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
        # Built field by field: dataclasses.replace costs more than the rest of the claim.
        self._staged[key] = _Row(
            row.fingerprint,
            state,
            row.generation,
            row.retention,
            now + row.retention,
            response,
            row.mode,
            row.lease_expires_at,
            row.created_at,
            now,
            row.note,
            row.epoch,
        )

    async def complete_and_commit(
        self, key: RecordKey, generation: int, state: State, response: StoredResponse
    ) -> None:
        await self.complete(key, generation, state, response)
        await self.commit()


class _MemoryFenced:
    """Settlements made in a fenced session apply when it ends cleanly, as a commit would."""

    def __init__(self, store: MemoryTables) -> None:
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

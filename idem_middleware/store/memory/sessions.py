"""The sessions the in-memory store hands out: a transaction that claims and completes, and a
fenced session whose settlements apply when it ends cleanly, as a commit would."""

from __future__ import annotations

from ...errors import StoreError
from ..base import (
    Claim,
    ClaimBusy,
    Claimed,
    Existing,
    RecordKey,
    Settlement,
    State,
    StoredResponse,
    TokenRefused,
)
from .tables import MemoryTables, _Pending, pending_row


class _MemoryTransaction:
    """A claim's transaction: what it stages applies at `finish`, as a commit would."""

    __slots__ = ("_claimed", "_consumed", "_held", "_staged", "_store", "active")

    def __init__(self, store: MemoryTables) -> None:
        self._store = store
        #: The records this transaction's claims stage, committed at `finish` (see `_Pending`).
        self._staged: dict[RecordKey, _Pending] = {}
        #: The keys this transaction claims (their entries in the store's `_owners`).
        self._held: set[RecordKey] = set()
        #: Tokens this transaction's claims consume, marked at commit (made when there is one).
        self._consumed: set[tuple[str, bytes]] | None = None
        #: The key this transaction claimed last (what `finish` records the outcome of).
        self._claimed: RecordKey | None = None
        self.active = False

    async def __aenter__(self) -> _MemoryTransaction:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.active:
            self._end()

    #: No driver connection: the handler writes wherever it likes (a class attribute: no call).
    connection = None

    def conflict(self, exc: BaseException) -> bool:
        return False  # the twin never refuses a transaction

    async def begin(self) -> None:
        """Begin before the claim (the claim otherwise does): for tests that hold a key first."""
        self.active = True

    async def abandon(self) -> None:
        self._end()

    async def release(self) -> None:
        if self.active:
            self._end()

    def _end(self) -> None:
        self._staged.clear()
        self._consumed = None
        if self._held:
            owners = self._store._owners
            for key in self._held:
                event = owners.pop(key)
                if event is not None:
                    event.set()
            self._held.clear()
        self._claimed = None
        self.active = False

    async def claim(
        self,
        key: RecordKey,
        fingerprint: bytes,
        *,
        retention_seconds: float,
        wait_seconds: float,
        token_hash: bytes | None = None,
    ) -> Claim:
        self.active = True
        store = self._store
        now = store.clock()
        staged = self._staged.get(key)
        current = store._rows.get(key) if staged is None else pending_row(staged)
        if current is not None:
            record = current.record(key, now)
            if not record.expired:
                self._settled()
                return Existing(record)  # a replay: no wait, no lock
        if key in store._owners and key not in self._held:
            # Another transaction is claiming it: never wait here (see ClaimBusy).
            self._end()
            raise ClaimBusy("another transaction is claiming this key")
        if token_hash is not None:
            reason = store._token_problem(key, token_hash, fingerprint)
            if reason:
                self._settled()
                return TokenRefused(reason)
            if self._consumed is None:
                self._consumed = set()
            self._consumed.add((key.tenant, token_hash))
        generation = next(store._generations)
        self._staged[key] = (fingerprint, generation, retention_seconds, now)
        store._owners[key] = None  # an event is made only if a lease claim waits
        self._held.add(key)
        self._claimed = key
        return Claimed(generation, generation)  # a fresh record: its epoch

    def _settled(self) -> None:
        """A claim that did not claim ends the transaction, unless it holds an earlier claim."""
        if not self._held:
            self._end()

    async def finish(self, state: State, response: StoredResponse) -> None:
        key = self._claimed
        pending = None if key is None else self._staged.get(key)
        if key is None or pending is None:
            raise StoreError("completion matched no pending record")
        now = self._store.clock()
        rows = self._store._rows
        staged = self._staged
        if len(staged) == 1:
            rows.put_completed(key, pending, state, now, response)
        else:  # the transaction's earlier claims commit too, as the pending records they are
            for other, claimed in staged.items():
                if other == key:
                    rows.put_completed(key, pending, state, now, response)
                else:
                    rows.put(other, pending_row(claimed))
        if self._consumed is not None:
            for token in self._consumed:
                self._store._consume(token, True)
        self._end()


class _MemoryFenced:
    """A fenced session: its settlement applies at once, as PostgreSQL's commits with it."""

    def __init__(self, store: MemoryTables, key: RecordKey, generation: int, expected: State):
        self._store = store
        self._fence = (key, generation, expected)

    @property
    def connection(self) -> None:
        return None

    async def settle(self, s: Settlement) -> bool:
        key, generation, expected = self._fence
        if self._store._current(key, generation, expected) is None:
            return False
        self._store._settle_now(key, generation, expected, s)
        return True

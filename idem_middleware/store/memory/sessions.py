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
    lapsed,
)
from .tables import MemoryTables, _Pending, pending_row


class _MemoryTransaction:
    """A claim's transaction: what it stages applies at `finish`, as a commit would.

    Almost every transaction claims one key: that claim is kept in two fields (`_claimed`,
    `_pending`), and a dictionary is made only for a transaction holding more than one key, so a
    request allocates no container for its claim (each is an object for the collector)."""

    __slots__ = ("_claimed", "_consumed", "_earlier", "_pending", "_store", "active")

    def __init__(self, store: MemoryTables) -> None:
        self._store = store
        #: The key this transaction claimed last (what `finish` records the outcome of), and the
        #: record its claim stages, committed at `finish` (see `_Pending`).
        self._claimed: RecordKey | None = None
        self._pending: _Pending | None = None
        #: Keys held before the last claim: their staged records (None: held, nothing staged).
        self._earlier: dict[RecordKey, _Pending | None] | None = None
        #: Tokens this transaction's claims consume, each with its claim's epoch, marked at commit
        #: (made when there is one).
        self._consumed: dict[tuple[str, bytes], int] | None = None
        self.active = False

    async def __aenter__(self) -> _MemoryTransaction:
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self.active:
            self._end()

    #: No driver connection: the handler writes wherever it likes (a class attribute: no call).
    connection = None

    def conflict(self, exc: BaseException) -> bool:
        return False  # the twin never refuses a transaction

    def lost(self) -> StoreError | None:
        return None  # nor loses its connection

    async def begin(self) -> None:
        """Begin before the claim (the claim otherwise does): for tests that hold a key first."""
        self.active = True

    def hold(self, key: RecordKey) -> None:
        """Hold `key` as an uncommitted claim does, staging nothing (for tests). The last
        claim stays the one `finish` completes."""
        self._store._owners.add(key)
        if key != self._claimed:
            self._earlier_keys()[key] = None

    def _earlier_keys(self) -> dict[RecordKey, _Pending | None]:
        if self._earlier is None:
            self._earlier = {}
        return self._earlier

    def _holds(self, key: RecordKey) -> bool:
        earlier = self._earlier
        return key == self._claimed or (earlier is not None and key in earlier)

    async def abandon(self) -> None:
        self._end()

    async def release(self) -> None:
        if self.active:
            self._end()

    def _end(self) -> None:
        if self._consumed is not None:
            self._store._held_tokens.difference_update(self._consumed)
            self._consumed = None
        owners = self._store._owners
        if self._claimed is not None:
            owners.remove(self._claimed)
            self._claimed = self._pending = None
        if self._earlier is not None:
            owners.difference_update(self._earlier)
            self._earlier = None
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
        if key == self._claimed:
            staged = self._pending
        else:
            staged = None if self._earlier is None else self._earlier.get(key)
        current = store._rows.get(key) if staged is None else pending_row(staged)
        released = False
        if current is not None:
            record = current.record(key, now)
            # (A lease-mode record released for this request's retry is claimed: see the
            # protocol's `claim`; its row is replaced at `finish`, left as it was otherwise.)
            released = record.retry_allowed and record.fingerprint == fingerprint
            # A released record another transaction is taking over is busy for any request, as
            # on PostgreSQL, where that transaction holds its row.
            reclaimed = record.retry_allowed and key in store._owners and not self._holds(key)
            if not (record.expired or released or reclaimed):
                self._settled()
                # (By a statement after the transaction, as PostgreSQL's: one that holds an
                # earlier claim goes on, and leaves the record as it is.)
                if lapsed(record, fingerprint) and not self.active:
                    record = store._expire_lapsed(key, record)
                return Existing(record)  # a replay: no wait, no lock
        if key in store._owners and not self._holds(key):
            # Another transaction is claiming it: never wait here (see ClaimBusy).
            self._end()
            raise ClaimBusy("another transaction is claiming this key")
        if token_hash is not None and not released:  # (a released record spent its token)
            reason = store._token_problem(key, token_hash, fingerprint)
            if reason:
                self._settled()
                if self.active:  # (it holds an earlier claim: see `_settled`)
                    # As PostgreSQL's transaction keeps the key's claim lock it took to judge it.
                    self.hold(key)
                return TokenRefused(reason)
            store._held_tokens.add((key.tenant, token_hash))
        generation = next(store._generations)
        if token_hash is not None and not released:
            if self._consumed is None:
                self._consumed = {}
            self._consumed[(key.tenant, token_hash)] = generation  # (a fresh record: its epoch)
        if self._claimed is not None and key != self._claimed:
            # A second key in one transaction: the first claim moves among the earlier ones.
            self._earlier_keys()[self._claimed] = self._pending
        if self._earlier is not None:
            self._earlier.pop(key, None)  # claimed again: it is the last claim now
        if released and current is not None:
            # Taken over, the record keeps its creation time and its audit trail (see _Pending).
            self._pending = (
                fingerprint,
                generation,
                retention_seconds,
                current.created_at,
                current.note,
            )
        else:
            self._pending = (fingerprint, generation, retention_seconds, now, None)
        store._owners.add(key)
        self._claimed = key
        return Claimed(generation, generation)  # a fresh record: its epoch

    def _settled(self) -> None:
        """A claim that did not claim ends the transaction, unless it holds an earlier claim."""
        if self._claimed is None and not self._earlier:
            self._end()

    async def finish(self, state: State, response: StoredResponse) -> None:
        key, pending = self._claimed, self._pending
        if key is None or pending is None:
            raise StoreError("completion matched no pending record")
        now = self._store.clock()
        rows = self._store._rows
        if self._earlier is not None:
            # The transaction's earlier claims commit too, as the pending records they are (in
            # the order claimed, as the rows of one commit would be).
            for other, claimed in self._earlier.items():
                if claimed is not None:
                    rows.put(other, pending_row(claimed))
        rows.put_completed(key, pending, state, now, response)
        if self._consumed is not None:
            for token, epoch in self._consumed.items():
                self._store._consume(token, epoch)
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

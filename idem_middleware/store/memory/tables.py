"""What the twin's "database" holds, and the row-level primitives every operation builds on.

PostgreSQL gives the real store these for free: rows and tokens, one generation sequence, the
row lock an UPDATE waits on, a compare-and-set on `(state, generation)`, and NOTIFY. Here they
are written out once; the sessions and the store's operations use nothing else.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from ..base import Record, RecordKey, RecordSummary, Settlement, State, StoredResponse
from .clock import checked_clock, wall_clock


@dataclass(frozen=True, slots=True)
class _Token:
    operation: str
    request_digest: bytes | None
    expires_at: float
    intent_id: str | None = None
    #: The epoch of the life that consumed it (None: unused): only that life's release frees it.
    consumed_by: int | None = None

    @property
    def consumed(self) -> bool:
        return self.consumed_by is not None


@dataclass(slots=True)
class _Row:
    """A record's row. Treated as immutable once in `_rows` (changes replace it); a claim's
    staged row, which nobody else sees, is completed in place. (Not frozen: a frozen dataclass
    sets each of its fields through object.__setattr__, a cost on every claim.)"""

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
    #: The generation an operator's `reopen` drew (see RecordSummary.reopened).
    reopened_generation: int | None = None

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


#: A transactional claim's staged record: (fingerprint, generation, retention, created_at, note).
#: Every other field of its row is a constant until its outcome (see `pending_row`), so the claim
#: stages these, and the outcome is packed straight from them. A fresh claim's note is None; a
#: released record the claim takes over keeps its creation time and its audit trail (as
#: queries.sql `reclaim_released` keeps them).
_Pending = tuple[bytes, int, float, float, str | None]


def pending_row(pending: _Pending) -> _Row:
    """The row a staged claim stands for: pending, transactional, its first generation its
    epoch."""
    fingerprint, generation, retention, created_at, note = pending
    return _Row(
        fingerprint,
        State.PENDING,
        generation,
        retention,
        created_at=created_at,
        updated_at=created_at,
        note=note,
        epoch=generation,
    )


_STATES = {state.value: state for state in State}
#: Each state's plain string, as a record keeps it (a lookup: `.value` is two Python calls).
_VALUES = {state: state.value for state in State}
#: Header pairs a record's headers are joined by `sum` up to (see `_Rows.put`).
_SUMMED_PAIRS = 16


class _Rows:
    """The committed rows, kept in a form the cyclic garbage collector soon stops tracking.

    A store that keeps every record makes each of them an object the collector passes over: a
    row, its response and the response's header list stay tracked for good, and every record
    committed moves the next full collection (a pass over the whole heap) closer. Kept as one
    flat tuple of strings, bytes and numbers (the state by its value, the headers as one tuple
    of names and values; the key as a plain tuple), a record is untracked by the second
    collection it lives through (the first untracks its headers), before it could reach the
    oldest generation. Rows are rebuilt on each read: a `_Row` read from here is a copy.
    """

    __slots__ = ("_packed",)

    def __init__(self) -> None:
        self._packed: dict[tuple[str, ...], tuple[Any, ...]] = {}

    @staticmethod
    def _unpack(p: tuple[Any, ...]) -> _Row:
        response = None
        if p[11] is not None:
            flat = p[12]
            pairs = list(zip(flat[::2], flat[1::2], strict=True))
            response = StoredResponse(p[11], pairs, p[13], p[14])
        return _Row(
            p[0],
            _STATES[p[10]],
            p[1],
            p[2],
            p[3],
            response,
            p[4],
            p[5],
            p[6],
            p[7],
            p[8],
            p[9],
            p[15],
        )

    def get(self, key: RecordKey) -> _Row | None:
        packed = self._packed.get(key)
        return None if packed is None else self._unpack(packed)

    def __getitem__(self, key: RecordKey) -> _Row:
        return self._unpack(self._packed[key])

    def __setitem__(self, key: RecordKey, row: _Row) -> None:
        self.put(key, row)

    def __delitem__(self, key: RecordKey) -> None:
        del self._packed[key]

    def __contains__(self, key: object) -> bool:
        return key in self._packed

    def __len__(self) -> int:
        return len(self._packed)

    def put(self, key: RecordKey, row: _Row) -> None:
        # Flat: the collector untracks a tuple only once everything in it is untracked, and it
        # reaches a nested tuple after the one holding it, so each level of nesting would keep
        # a record tracked one collection longer (into the oldest generation, at three levels).
        # (A RecordKey is a named tuple, which the collector never untracks; a plain tuple of
        # the same strings hashes and compares equal to it.) The fields are read one by one:
        # an attrgetter and a star would build the same tuple twice.
        r = row.response
        headers: tuple[bytes, ...] | None
        if r is None:
            status = headers = body = omitted = None
        else:
            status, body, omitted = r.status, r.body, r.body_omitted
            headers = _flat(r.headers)
        self._packed[tuple(key)] = (
            row.fingerprint,
            row.generation,
            row.retention,
            row.expires_at,
            row.mode,
            row.lease_expires_at,
            row.created_at,
            row.updated_at,
            row.note,
            row.epoch,
            _VALUES[row.state],
            status,
            headers,
            body,
            omitted,
            row.reopened_generation,
        )

    def put_completed(
        self,
        key: RecordKey,
        pending: _Pending,
        state: State,
        now: float,
        response: StoredResponse,
    ) -> None:
        """Commit a staged claim (see `_Pending`) with its outcome: packed as `put` packs the
        completed row, without building the row."""
        fingerprint, generation, retention, created_at, note = pending
        self._packed[tuple(key)] = (
            fingerprint,
            generation,
            retention,
            now + retention,  # expires_at
            "transactional",  # mode
            None,  # lease_expires_at
            created_at,
            now,  # updated_at
            note,
            generation,  # epoch
            _VALUES[state],
            response.status,
            _flat(response.headers),
            response.body,
            response.body_omitted,
            None,  # reopened_generation
        )

    def items(self) -> Iterator[tuple[RecordKey, _Row]]:
        for key, packed in self._packed.items():
            yield RecordKey(*key), self._unpack(packed)


def _flat(pairs: Sequence[tuple[bytes, bytes]]) -> tuple[bytes, ...]:
    """Header pairs as one flat tuple of names and values (see `_Rows`)."""
    try:
        # Pairs of tuples, as the capture stores them, joined in C; a few only, as a sum copies
        # what it has joined so far at every step.
        if len(pairs) <= _SUMMED_PAIRS:
            return sum(pairs, ())
    except TypeError:  # pairs given as lists
        pass
    return tuple(itertools.chain.from_iterable(pairs))


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
        reopened=row.reopened_generation == row.generation,
    )


class _RowLock:
    """One record's row lock, kept only while someone holds it or waits for it: the last to
    leave removes it. (Kept for good, every key a lease-mode request, a fenced session or an
    operator's amendment ever touched left a lock behind, past its record's purge.)"""

    __slots__ = ("_key", "_lock", "_locks", "_users")

    def __init__(self, locks: dict[RecordKey, _RowLock], key: RecordKey) -> None:
        self._locks = locks
        self._key = key
        self._lock = asyncio.Lock()
        self._users = 0

    def locked(self) -> bool:
        return self._lock.locked()

    async def __aenter__(self) -> None:
        self._users += 1
        try:
            await self._lock.acquire()
        except BaseException:  # cancelled while waiting for it
            self._leave()
            raise

    async def __aexit__(self, *exc: object) -> None:
        self._lock.release()
        self._leave()

    def _leave(self) -> None:
        self._users -= 1
        if not self._users and self._locks.get(self._key) is self:
            del self._locks[self._key]


def appended(note: str | None, line: str) -> str:
    """The audit trail `note` with one more line, stamped with the wall time (UTC), as the
    database's `now()` stamps it (the store's clock decides expiry, not what the trail shows)."""
    stamped = f"{datetime.now(UTC).strftime('%Y-%m-%dT%H:%M:%SZ')} {line}"
    return stamped if note is None else f"{note}\n{stamped}"


class MemoryTables:
    """The state of one in-memory store. `clock` is the store's notion of the database's `now()`."""

    def __init__(self, *, clock: Callable[[], float] = wall_clock) -> None:
        self.clock = checked_clock(clock)
        self._rows = _Rows()
        #: Keys a transaction is claiming (nobody waits for one: a claim of it is ClaimBusy).
        self._owners: set[RecordKey] = set()
        self._generations = itertools.count(1)
        self._watchers: dict[RecordKey, set[asyncio.Event]] = {}
        #: The row locks held or waited for now (see `_RowLock`).
        self._fence_locks: dict[RecordKey, _RowLock] = {}
        self._tokens: dict[tuple[str, bytes], _Token] = {}
        #: Tokens an open transaction's claim consumes (PostgreSQL's claim holds their rows).
        self._held_tokens: set[tuple[str, bytes]] = set()
        #: The token each (tenant, operation, intent) was issued (the table's unique key).
        self._intents: dict[tuple[str, str, str], bytes] = {}
        #: `mark_asked`'s stamps, (generation, time) by key: the columns of migration 0012.
        self._asked: dict[RecordKey, tuple[int, float]] = {}

    def _current(self, key: RecordKey, generation: int, state: State) -> _Row | None:
        """The committed row, if it is in `state` under `generation`."""
        row = self._rows.get(key)
        if row is None or row.generation != generation or row.state is not state:
            return None
        return row

    def _row_lock(self, key: RecordKey) -> _RowLock:
        """The record's row lock (`async with`): a fenced session holds it, and every write to
        the record waits for it, as an UPDATE or DELETE waits on PostgreSQL's `SELECT ... FOR
        UPDATE`."""
        locks = self._fence_locks
        found = locks.get(key)
        if found is None:
            found = locks[key] = _RowLock(locks, key)
        return found

    def _expire_lapsed(self, key: RecordKey, record: Record) -> Record:
        """`expire_lapsed`: a lapsed lease-mode record becomes `unknown` now, unless a session
        holds (or waits for) its row lock, as SKIP LOCKED passes over a locked row."""
        row = self._current(key, record.generation, State.PENDING)
        if row is None or key in self._fence_locks:
            return record
        now = self.clock()
        if row.lease_expires_at is None or row.lease_expires_at > now:
            return record
        row = replace(
            row,
            state=State.UNKNOWN,
            lease_expires_at=None,
            updated_at=now,
            note=appended(row.note, "lease expired"),
        )
        self._rows[key] = row
        self._changed(key)
        return row.record(key, now)

    def _changed(self, key: RecordKey) -> None:
        for event in self._watchers.get(key, ()):
            event.set()

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
            note=row.note if s.note is None else appended(row.note, s.note),
        )
        self._changed(key)
        return True

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

    def _consume(self, token: tuple[str, bytes], by: int | None) -> None:  # (`consumed_by`)
        found = self._tokens.get(token)
        if found is not None:
            self._tokens[token] = replace(found, consumed_by=by)

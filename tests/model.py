"""A pure-Python reference model of one idempotency record's life (docs/protocol.md: the states).

It starts from the seed article's Go model (`Start`, `Commit`, `MarkUnknown`: one map, one
generation counter, retention judged by a clock) and adds what the library has on top: the
transactional claim that stays invisible until its commit, leases that lapse by the clock,
heartbeats, takeover under a new generation, `unknown` and its reconciliation (settle it, or let
the client's retry run it again), release, and purge.

It is deliberately naive: a dict, a counter and a float clock, no concurrency, no I/O. Every
operation either applies completely or returns a refusal (False / None) and changes nothing.
The model-based test drives it and the real stores side by side and compares them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

PENDING = "pending"
SUCCEEDED = "succeeded"
FAILED_FINAL = "failed_final"
UNKNOWN = "unknown"
FINAL = frozenset({SUCCEEDED, FAILED_FINAL})
STATES = (PENDING, SUCCEEDED, FAILED_FINAL, UNKNOWN)

TRANSACTIONAL = "transactional"
LEASE = "lease"

#: (tenant, operation, key): the key space.
Key = tuple[str, str, str]


@dataclass(frozen=True, slots=True)
class Entry:
    """A committed (or, in a transaction, staged) record."""

    fingerprint: bytes
    state: str
    generation: int
    retention: float
    mode: str = TRANSACTIONAL
    #: When the lease lapses (lease mode, pending only); None: no lease.
    lease_expires: float | None = None
    #: When the retention of a final outcome ends; None for pending and unknown.
    expires: float | None = None
    #: The stored response's status (final states only).
    status: int | None = None


class Model:
    def __init__(self) -> None:
        self.now = 0.0
        self.entries: dict[Key, Entry] = {}
        #: Transactional claims not yet committed: invisible to everyone else.
        self.staged: dict[Key, Entry] = {}
        self._last_generation = 0

    # -- views -------------------------------------------------------------------------------

    def get(self, key: Key) -> Entry | None:
        return self.entries.get(key)

    def expired(self, e: Entry) -> bool:
        """Retention over (Go: `!now.Before(e.Expires)`). Only final outcomes ever expire."""
        return e.expires is not None and e.expires <= self.now

    def lease_expired(self, e: Entry) -> bool:
        return e.lease_expires is not None and e.lease_expires <= self.now

    def retry_allowed(self, e: Entry) -> bool:
        """A pending lease record nobody executes: the client's next retry takes it over."""
        return e.state == PENDING and e.mode == LEASE and e.lease_expires is None

    def _new_generation(self) -> int:
        # One counter for all keys, never reused: a stale executor never matches a newer owner.
        self._last_generation += 1
        return self._last_generation

    def _current(self, key: Key, generation: int, state: str) -> Entry | None:
        e = self.entries.get(key)
        if e is None or e.generation != generation or e.state != state:
            return None
        return e

    # -- claims --------------------------------------------------------------------------------

    def claim(
        self,
        key: Key,
        fingerprint: bytes,
        *,
        mode: str,
        retention: float,
        lease: float | None = None,
    ) -> tuple[bool, Entry]:
        """Claim `key`, or return what holds it. An expired final outcome counts as absent.
        `lease` is None in transactional mode.

        A transactional claim is staged until `tx_commit`; a lease claim commits at once. The
        caller must not claim a key another transaction has staged: that claim would block.
        """
        assert key not in self.staged, "a claim on a key held by an open transaction blocks"
        current = self.entries.get(key)
        same = current is not None and current.fingerprint == fingerprint
        if mode == TRANSACTIONAL and same and current is not None:
            # A lease-mode record of this very request, its route transactional now: released
            # for the retry, the claim's transaction takes it over (rolled back, it is the
            # released record again); its lease lapsed, the claim marks it unknown (nothing
            # runs it, and its effect may have happened elsewhere) and answers that.
            if self.retry_allowed(current):
                fresh = Entry(fingerprint, PENDING, self._new_generation(), retention)
                self.staged[key] = fresh
                return True, fresh
            if current.state == PENDING and self.lease_expired(current):
                self.entries[key] = replace(current, state=UNKNOWN, lease_expires=None)
                return False, self.entries[key]
        if current is not None and not self.expired(current):
            return False, current
        fresh = Entry(
            fingerprint,
            PENDING,
            self._new_generation(),
            retention,
            mode=mode,
            lease_expires=None if lease is None else self.now + lease,
        )
        if mode == TRANSACTIONAL:
            self.staged[key] = fresh
        else:
            self.entries[key] = fresh
        return True, fresh

    def tx_complete(self, key: Key, generation: int, state: str, status: int) -> bool:
        """Record the outcome of the claim this transaction holds (not yet committed)."""
        e = self.staged.get(key)
        if e is None or e.generation != generation or e.state != PENDING or state not in FINAL:
            return False
        self.staged[key] = replace(e, state=state, status=status, expires=self.now + e.retention)
        return True

    def tx_commit(self, key: Key) -> None:
        self.entries[key] = self.staged.pop(key)

    def tx_rollback(self, key: Key) -> None:
        del self.staged[key]

    # -- lease mode ----------------------------------------------------------------------------

    def heartbeat(self, key: Key, generation: int, lease: float) -> bool:
        e = self._current(key, generation, PENDING)
        if e is None:
            return False
        # (never shortened: a renewal that lands late keeps a later one's end)
        until = self.now + lease
        if e.lease_expires is not None and e.lease_expires > until:
            until = e.lease_expires
        self.entries[key] = replace(e, lease_expires=until)
        return True

    def expire_lease(self, key: Key, generation: int) -> bool:
        """pending whose lease lapsed -> unknown: a lost lease does not prove nothing happened."""
        e = self._current(key, generation, PENDING)
        if e is None or e.lease_expires is None or e.lease_expires > self.now:
            return False
        self.entries[key] = replace(e, state=UNKNOWN, lease_expires=None)
        return True

    def takeover(self, key: Key, generation: int, expected: str, lease: float) -> int | None:
        """A new executor under a new generation: of a pending record whose lease lapsed (or
        that has none: released for a retry), or of an unknown one reconciled as "did not
        happen". Nothing else can be taken over: not an unknown transactional record (an
        operator reopened it; its writes committed with its outcome). What is taken over is a
        lease-mode record from then on."""
        if expected not in (PENDING, UNKNOWN):
            return None
        e = self._current(key, generation, expected)
        if e is None or (expected == UNKNOWN and e.mode != LEASE):
            return None
        if expected == PENDING and e.lease_expires is not None and e.lease_expires > self.now:
            return None
        new = self._new_generation()
        self.entries[key] = replace(
            e, state=PENDING, mode=LEASE, generation=new, lease_expires=self.now + lease
        )
        return new

    def settle(
        self, key: Key, generation: int, expected: str, state: str, status: int | None
    ) -> bool:
        """`expected` under `generation` -> a final outcome (with its response and retention)
        or unknown (with neither). From unknown, this is the reconciliation "it happened"."""
        e = self._current(key, generation, expected)
        if e is None:
            return False
        final = state in FINAL
        self.entries[key] = replace(
            e,
            state=state,
            status=status if final else None,
            expires=self.now + e.retention if final else None,
            lease_expires=None,
        )
        return True

    def release(self, key: Key, generation: int) -> bool:
        """Forget a pending claim whose request did nothing."""
        if self._current(key, generation, PENDING) is None:
            return False
        del self.entries[key]
        return True

    def allow_retry(self, key: Key, generation: int) -> int | None:
        """unknown -> pending under a new generation and without a lease (reconciliation:
        it did not happen); the client's next retry takes it over."""
        e = self._current(key, generation, UNKNOWN)
        if e is None:
            return None
        new = self._new_generation()
        self.entries[key] = replace(e, state=PENDING, generation=new, lease_expires=None)
        return new

    # -- time and retention --------------------------------------------------------------------

    def advance(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds

    def purge(self) -> int:
        """Delete final outcomes whose retention is over; never pending or unknown, never a
        record an open transaction holds."""
        doomed = [
            k
            for k, e in self.entries.items()
            if e.state in FINAL and self.expired(e) and k not in self.staged
        ]
        for k in doomed:
            del self.entries[k]
        return len(doomed)

    # -- the seed's Go model, in its own words ---------------------------------------------------

    def start(
        self, key: Key, fingerprint: bytes, *, retention: float = 3600.0
    ) -> tuple[Entry, str]:
        """Go's `Store.Start`: claim (committed at once), or what a duplicate gets (§3)."""
        # Go's Start holds no lease: the entry stays pending until Commit or MarkUnknown.
        claimed, e = self.claim(key, fingerprint, mode=LEASE, retention=retention, lease=None)
        if claimed:
            return e, "claimed"
        return e, verdict(e, fingerprint)

    def commit(self, key: Key, generation: int, status: int = 200) -> bool:
        """Go's `Store.Commit`: pending under `generation` -> succeeded."""
        return self.settle(key, generation, PENDING, SUCCEEDED, status)

    def mark_unknown(self, key: Key, generation: int) -> bool:
        """Go's `Store.MarkUnknown`: pending under `generation` -> unknown."""
        return self.settle(key, generation, PENDING, UNKNOWN, None)

    # -- self-checks ---------------------------------------------------------------------------

    def check(self) -> None:
        """The shape every entry must have, whatever happened before."""
        for e in (*self.entries.values(), *self.staged.values()):
            final = e.state in FINAL
            assert final == (e.expires is not None), e
            assert final == (e.status is not None), e
            assert e.state == PENDING or e.lease_expires is None, e
        generations = [e.generation for e in (*self.entries.values(), *self.staged.values())]
        assert len(generations) == len(set(generations)), "a generation is held twice"


def verdict(e: Entry, fingerprint: bytes) -> str:
    """What a duplicate gets (docs/protocol.md): the fingerprint first, in any state."""
    if e.fingerprint != fingerprint:
        return "conflict"
    if e.state in FINAL:
        return "replay"
    return e.state

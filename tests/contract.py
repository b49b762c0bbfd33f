"""The store contract's harness: one store of each kind, plus what the protocol does not offer.

Every contract test (tests/integration/test_store_contract.py, test_lease_contract.py,
test_seed_model.py, test_cli_resolve.py) takes the `harness` fixture. tests/conftest.py
parametrises it (see `HARNESS_CASES`): `MemoryStore` with a fake clock; `PostgresStore` on a real
PostgreSQL with the fast path on and off (time is simulated there by editing rows, since `now()`
is the database's clock); and, for modules that opt in with `pytest.mark.db_routes`, PostgreSQL
through PgBouncer or on a partitioned table.

Beyond the store, a harness ends a key's retention, purges a key, plants an old unresolved
record, records a business effect, holds a key's lock, lapses a lease and waits until an
operation is blocked on another session.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import asyncpg
import pytest

from idem_middleware.store import Claim, Claimed, MemoryStore, RecordKey, State, StoredResponse
from idem_middleware.store.memory import _Row
from idem_middleware.store.postgres import PostgresStore
from tests.apps import wait_for_lock_waiters

FP = b"\x01" * 32
OTHER_FP = b"\x02" * 32
RETENTION = 3600.0
TEN_YEARS = 10 * 365 * 24 * 3600.0
RESPONSE = StoredResponse(
    status=201,
    headers=[(b"content-type", b"application/json")],
    body=b'{"ok":true}',
)

#: (harness id, store kind, fast path, database route) for every contract test; the extra routes
#: a module names in `pytest.mark.db_routes` add a ("postgres", True, route) case each.
HARNESS_CASES = [
    ("memory", "memory", True, "direct"),
    ("postgres", "postgres", True, "direct"),
    ("postgres-nofast", "postgres", False, "direct"),
]


def key(name: str = "k1", *, tenant: str = "tenant-a", operation: str = "POST /x") -> RecordKey:
    return RecordKey(tenant, operation, name)


async def claim(session: Any, k: RecordKey, fingerprint: bytes = FP, *, wait: float = 5.0) -> Claim:
    return await session.claim(k, fingerprint, retention_seconds=RETENTION, wait_seconds=wait)


class FakeClock:
    """The memory store's `now()`: moves only when a test moves it."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


@asynccontextmanager
async def _session(store: Any, begin: bool) -> AsyncIterator[Any]:
    async with store.transaction(acquire_timeout=10) as session:
        if begin:
            await session.begin()  # not part of the store protocol: the claim begins it
        yield session


class MemoryHarness:
    kind = "memory"

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.store = MemoryStore(clock=self.clock)
        self._effects: Counter[RecordKey] = Counter()

    def transaction(self, *, begin: bool = False) -> Any:
        """A session as the middleware opens it: BEGIN travels with the claim. A test that does
        anything in the session before it claims asks for `begin=True`."""
        return _session(self.store, begin)

    async def effect(self, session: Any, k: RecordKey) -> None:
        # The twin has no business tables: an effect is counted when the claimer performs it.
        self._effects[k] += 1

    async def effects(self, k: RecordKey) -> int:
        return self._effects[k]

    async def end_retention(self, k: RecordKey, *, after: float = 0.0, session: Any = None) -> None:
        """Make the key's retention end `after` seconds from the store's now (0: it ends now)."""
        row = self.store._rows[k]
        assert row.expires_at is not None, "only a finished record has a retention end"
        self.clock.now = row.expires_at - after

    async def purge(self, k: RecordKey) -> None:
        del self.store._rows[k]

    async def put_unresolved(self, k: RecordKey, fingerprint: bytes, state: State) -> int:
        """A committed pending/unknown record, then ten years pass."""
        generation = next(self.store._generations)
        self.store._rows[k] = _Row(fingerprint, state, generation, RETENTION)
        self.clock.now += TEN_YEARS
        return generation

    async def age(self, seconds: float, *, session: Any = None) -> None:
        self.clock.now += seconds

    async def hold_key_lock(self, session: Any, k: RecordKey) -> None:
        """Make `session` hold the key as an uncommitted claim does (until it ends)."""
        session.hold(k)

    async def lapse(self, k: RecordKey) -> None:
        """End the lease of one record now (the store's clock stays where it is)."""
        current = self.store._rows[k]
        assert current.lease_expires_at is not None
        self.store._rows[k] = replace(current, lease_expires_at=self.clock.now - 1.0)

    async def tick(self) -> None:
        self.clock.now += 1.0

    async def wait_until_blocked(self, task: asyncio.Task[Any]) -> None:
        await asyncio.sleep(0.05)
        assert not task.done(), "the operation should wait for the fenced session"


class PgHarness:
    kind = "postgres"

    def __init__(self, store: PostgresStore, pool: asyncpg.Pool[Any]) -> None:
        self.store = store
        self.pool = pool

    def transaction(self, *, begin: bool = False) -> Any:
        """As MemoryHarness.transaction: with the fast path on, BEGIN and the claim travel in
        one message, as the middleware's claims do (unless the test asks for `begin=True`)."""
        return _session(self.store, begin)

    async def effect(self, session: Any, k: RecordKey) -> None:
        # On the session's connection, inside the claim's transaction.
        await session.connection.execute(
            "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ($1, $2, 1)",
            k.tenant,
            f"{k.operation}|{k.key}",
        )

    async def effects(self, k: RecordKey) -> int:
        count: int = await self.pool.fetchval(
            "SELECT count(*) FROM test_ledger WHERE tenant = $1 AND account_id = $2",
            k.tenant,
            f"{k.operation}|{k.key}",
        )
        return count

    async def end_retention(self, k: RecordKey, *, after: float = 0.0, session: Any = None) -> None:
        """expires_at = now() + after; inside `session` that is the very now() its claim sees."""
        conn = self.pool if session is None else session.connection
        status = await conn.execute(
            "UPDATE idem_requests SET expires_at = now() + make_interval(secs => $4::float8)"
            " WHERE tenant = $1 AND operation = $2 AND idem_key = $3 AND expires_at IS NOT NULL",
            k.tenant,
            k.operation,
            k.key,
            after,
        )
        assert status == "UPDATE 1", "only a finished record has a retention end"

    async def purge(self, k: RecordKey) -> None:
        status = await self.pool.execute(
            "DELETE FROM idem_requests WHERE tenant = $1 AND operation = $2 AND idem_key = $3",
            k.tenant,
            k.operation,
            k.key,
        )
        assert status == "DELETE 1"

    async def put_unresolved(self, k: RecordKey, fingerprint: bytes, state: State) -> int:
        """A lease-mode pending/unknown record created ten years ago (a pending one's lease too)."""
        generation: int = await self.pool.fetchval(
            """
            INSERT INTO idem_requests AS r (tenant, operation, idem_key, fingerprint, state, mode,
                                            retention, created_at, updated_at, lease_expires_at)
            VALUES ($1, $2, $3, $4, $5, 'lease', interval '1 hour',
                    now() - interval '10 years', now() - interval '10 years',
                    CASE WHEN $5 = 'pending' THEN now() - interval '10 years' END)
            RETURNING r.generation
            """,
            k.tenant,
            k.operation,
            k.key,
            fingerprint,
            state.value,
        )
        return generation

    async def age(self, seconds: float, *, session: Any = None) -> None:
        conn = self.pool if session is None else session.connection
        await conn.execute(
            "UPDATE idem_requests SET created_at = created_at - make_interval(secs => $1::float8),"
            " updated_at = updated_at - make_interval(secs => $1::float8)",
            seconds,
        )

    async def hold_key_lock(self, session: Any, k: RecordKey) -> None:
        """Make `session` hold the key's advisory lock, as an uncommitted claim does."""
        await session.connection.execute(
            "SELECT pg_advisory_xact_lock(idem_key_lock($1, $2, $3))",
            k.tenant,
            k.operation,
            k.key,
        )

    async def lapse(self, k: RecordKey) -> None:
        status = await self.pool.execute(
            "UPDATE idem_requests SET lease_expires_at = now() - interval '1 second'"
            " WHERE tenant = $1 AND operation = $2 AND idem_key = $3",
            k.tenant,
            k.operation,
            k.key,
        )
        assert status == "UPDATE 1"

    async def tick(self) -> None:
        await asyncio.sleep(0.002)  # now() moves between transactions

    async def wait_until_blocked(self, task: asyncio.Task[Any]) -> None:
        await wait_for_lock_waiters(self.pool)
        assert not task.done()


Harness = MemoryHarness | PgHarness


@pytest.fixture
def harness(request: pytest.FixtureRequest, fast_path: bool, db_route: str) -> Harness:
    """The store under contract (parametrised by tests/conftest.py's `pytest_generate_tests`);
    `fast_path` and `db_route` configure conftest's `pool` and `pg_store` for it."""
    if request.param == "memory":
        return MemoryHarness()
    # Only the PostgreSQL cases need the database (the pool fixture empties the tables).
    return PgHarness(request.getfixturevalue("pg_store"), request.getfixturevalue("pool"))


async def claim_in_session(
    harness: Harness, k: RecordKey, *, wait: float, complete: bool = True
) -> Claim:
    """A claim in a session of its own; completed (succeeded, RESPONSE) and committed if it won."""
    async with harness.transaction() as session:
        result = await claim(session, k, wait=wait)
        if isinstance(result, Claimed) and complete:
            await session.finish(State.SUCCEEDED, RESPONSE)
        return result

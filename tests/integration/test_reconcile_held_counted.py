"""A record another session holds is passed over by `reconcile_unknown` and counted in the
report's `held` (what `idem-middleware reconcile` prints: "the next run looks at them again"),
both for a lapsed lease it would mark unknown and for an unknown record it would reconcile: a
report saying nothing was held would tell the operator that nothing is left to do."""

from __future__ import annotations

import asyncio
from typing import Any

from idem_middleware.ops import reconcile_unknown
from idem_middleware.store.base import Claimed, RecordKey, State
from idem_middleware.store.postgres import PostgresStore

OP = "POST /payouts"


async def _lapsed(store: PostgresStore, key: RecordKey) -> int:
    claim = await store.claim_lease(key, b"\x00" * 32, retention_seconds=60, lease_seconds=0.2)
    assert isinstance(claim, Claimed), claim
    await asyncio.sleep(0.3)  # its executor died: the lease lapses
    return claim.generation


async def _reconciled_while_held(store: PostgresStore, key: RecordKey) -> Any:
    """`reconcile_unknown`'s report, run while another session holds `key`'s row."""
    async with store.pool.acquire() as conn, conn.transaction():
        await conn.execute(
            "SELECT 1 FROM idem_requests WHERE tenant = $1 AND operation = $2 AND idem_key = $3"
            " FOR UPDATE",
            key.tenant,
            key.operation,
            key.key,
        )
        return await asyncio.wait_for(reconcile_unknown(store, {OP: _fencing}, seconds=0.5), 10)


_passed: list[str] = []


async def _fencing(context: Any) -> Any:
    """A reconciler that looks with its fenced connection first (held: refused)."""
    await context.fenced_connection()
    _passed.append("fenced")  # pragma: no cover - the record is held
    raise AssertionError("a held record's fence is refused")


async def test_a_held_unknown_record_is_counted_as_held(pg_store: PostgresStore) -> None:
    key = RecordKey("tenant-a", OP, "held-unknown")
    generation = await _lapsed(pg_store, key)
    assert await pg_store.expire_lease(key, generation)
    record = await pg_store.get(key)
    assert record is not None
    assert record.state is State.UNKNOWN
    report = await _reconciled_while_held(pg_store, key)
    assert _passed == []
    assert report.held == 1
    assert report.verdicts == {}


async def test_a_held_lapsed_lease_is_counted_as_held(pg_store: PostgresStore) -> None:
    key = RecordKey("tenant-a", OP, "held-lapsed")
    await _lapsed(pg_store, key)
    report = await _reconciled_while_held(pg_store, key)
    assert report.held == 1
    assert report.expired_leases == 0
    record = await pg_store.get(key)
    assert record is not None
    assert record.state is State.PENDING

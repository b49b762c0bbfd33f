"""A transactional route that never waits (`wait_seconds=0`) finding a lapsed lease-mode record
of the same request: it is marked `unknown` all the same (409 outcome-unknown), the statement
given the little time it needs to run (claim.expire_lapsed's minimum), not refused at once by
asyncpg's zero timeout as the store's trouble (503)."""

from __future__ import annotations

from typing import Any

import asyncpg

from idem_middleware import PostgresStore, RecordKey
from idem_middleware.store.base import Claimed
from tests.apps import PAYOUTS, assert_problem, build_lease_app, client, count
from tests.integration.test_lease_mode import (
    bank,  # noqa: F401 (a fixture)
    post,
    probe_of,
    row,
)
from tests.integration.test_mode_change import TRANSACTIONAL, _fingerprint_of


async def test_a_lapsed_lease_found_by_a_route_that_never_waits_is_marked_unknown(
    pool: asyncpg.Pool[Any],
    pg_store: PostgresStore,
    bank: asyncpg.Pool[Any],  # noqa: F811
) -> None:
    key = RecordKey("tenant-a", f"POST {PAYOUTS}", "k1")
    claim = await pg_store.claim_lease(key, b"-", retention_seconds=60, lease_seconds=60)
    assert isinstance(claim, Claimed)
    await bank.execute("UPDATE idem_requests SET lease_expires_at = now() - interval '1 second'")
    new = build_lease_app(pg_store, bank, TRANSACTIONAL.replace(wait_seconds=0.0))
    async with client(new) as c:
        await bank.execute(
            "UPDATE idem_requests SET fingerprint = $1", await _fingerprint_of(c, bank)
        )
        assert_problem(await post(c), 409, "outcome-unknown")
    assert probe_of(new).calls == 1  # the "probe" key's, none for k1
    assert await count(bank, "test_ledger") == 0
    record = await row(bank)
    assert record is not None
    assert record["state"] == "unknown"

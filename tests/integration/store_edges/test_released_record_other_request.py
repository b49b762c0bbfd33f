"""A lease-mode record released for the client's retry, its route transactional now, claimed
by ANOTHER request under the same key (a different body): `key-reused` 422, the handler never
run and the record left as it was (claim.py: `reclaim_released`'s `same` false). Only the same
request takes a released record over (test_mode_change.py has that one)."""

from __future__ import annotations

from typing import Any

import asyncpg

from idem_middleware import PostgresStore, RecordKey
from idem_middleware.store.base import Claimed, Settlement, State
from tests.apps import PAYOUTS, Step, assert_problem, build_lease_app, client, count
from tests.integration.test_lease_mode import (
    bank,  # noqa: F401 (a fixture)
    post,
    probe_of,
    row,
)
from tests.integration.test_mode_change import TRANSACTIONAL


async def test_a_released_record_is_not_taken_over_by_another_request(
    pool: asyncpg.Pool[Any],
    pg_store: PostgresStore,
    bank: asyncpg.Pool[Any],  # noqa: F811
) -> None:
    key = RecordKey("tenant-a", f"POST {PAYOUTS}", "k1")
    # (fingerprint b"-": no request of the app's has it)
    claim = await pg_store.claim_lease(key, b"-", retention_seconds=60, lease_seconds=60)
    assert isinstance(claim, Claimed)
    assert await pg_store.settle(key, claim.generation, State.PENDING, Settlement(State.UNKNOWN))
    assert await pg_store.allow_retry(key, claim.generation, "not at the bank")
    before = await row(bank)
    assert before is not None
    new = build_lease_app(pg_store, bank, TRANSACTIONAL)
    probe_of(new).steps = [Step(downstream=False, fence="before")]
    async with client(new) as c:
        other = await post(c)
    assert_problem(other, 422, "key-reused")
    assert probe_of(new).calls == 0
    assert await count(bank, "test_ledger") == 0
    record = await row(bank)
    assert record is not None
    assert (record["state"], record["mode"], record["generation"]) == (
        "pending",
        "lease",
        before["generation"],
    )

"""A second claim in one transaction session after a fast (deferred) claim: the fast claim's
record is written first (`write_deferred`), so the second claim of the same key sees it pending
(Existing, the first claim's generation), as the ordinary path and the in-memory twin answer,
instead of claiming the key a second time in the same transaction. (The store's contract,
test_store_contract.py, checks this with `begin=True`, which takes the ordinary path only.)"""

from __future__ import annotations

import uuid

from idem_middleware import PostgresStore
from idem_middleware.store.base import Claimed, Existing, RecordKey, State


async def test_a_second_claim_after_a_fast_one_sees_its_pending_record(db_dsn: str) -> None:
    k = RecordKey("tenant-a", "POST /x", uuid.uuid4().hex)
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False)
    async with store, store.transaction(acquire_timeout=5.0) as session:
        first = await session.claim(k, b"f" * 32, retention_seconds=60.0, wait_seconds=0.2)
        assert isinstance(first, Claimed)
        again = await session.claim(k, b"f" * 32, retention_seconds=60.0, wait_seconds=0.2)
        assert isinstance(again, Existing), again
        assert again.record.state is State.PENDING
        assert again.record.generation == first.generation

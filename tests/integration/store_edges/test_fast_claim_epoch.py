"""A fresh key claimed by the fast path has the epoch its record is written with (its first
generation: store/base.py `Claimed.epoch`): the downstream key the handler sends
(`ctx.downstream_key`, derived from the epoch) is then the one a reconciler derives later from
the record, and a retry after a rollback claims under another epoch and sends another key.
(fused.py `begin_and_claim`: `Claimed(generation, generation)`.)"""

from __future__ import annotations

import uuid

from idem_middleware import PostgresStore
from idem_middleware.context import derive_downstream_key
from idem_middleware.store.base import Claimed, RecordKey, State, StoredResponse


async def test_a_fast_claims_epoch_is_its_records(db_dsn: str) -> None:
    key = RecordKey("tenant-a", "POST /x", uuid.uuid4().hex)
    async with PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False) as store:
        async with store.transaction(acquire_timeout=5.0) as session:
            claimed = await session.claim(key, b"f" * 32, retention_seconds=60.0, wait_seconds=0.2)
            assert isinstance(claimed, Claimed)
            await session.finish(State.SUCCEEDED, StoredResponse(201, [], b"{}", None))
        record = await store.get(key)
    assert record is not None
    assert claimed.epoch == claimed.generation == record.epoch
    assert derive_downstream_key(*key, claimed.epoch) == derive_downstream_key(*key, record.epoch)

"""A transactional claim whose wait for another session's uncommitted record of the same key
(one written without the key's claim lock: an operator's INSERT, a migration's copy) is cut
short by the server's `statement_timeout` is ClaimTimeout (the request is told the key is in
flight, 409, and may retry), as the client's own bound is, not StoreError (a 503 that blames the
store): QueryCanceledError is one of `WAIT_EXCEEDED` (convert.py), and sessions.py turns a wait
that ran out inside `claim` into ClaimTimeout."""

from __future__ import annotations

import uuid

import asyncpg
import pytest

from idem_middleware import PostgresStore
from idem_middleware.errors import ClaimBusy, ClaimTimeout, StoreError
from idem_middleware.store.base import RecordKey


async def test_a_claim_wait_the_server_cancels_is_a_claim_timeout(db_dsn: str) -> None:
    k = RecordKey("tenant-a", "POST /x", uuid.uuid4().hex)
    other = await asyncpg.connect(db_dsn)
    store = PostgresStore(
        dsn=db_dsn,
        min_size=1,
        max_size=2,
        listen=False,
        fast_path=False,  # (the ordinary claim: its INSERT meets the uncommitted row)
        connect_kwargs={"server_settings": {"statement_timeout": "300"}},
    )
    try:
        tx = other.transaction()
        await tx.start()
        await other.execute(
            "INSERT INTO idem_requests (tenant, operation, idem_key, fingerprint, state, mode,"
            " retention) VALUES ($1, $2, $3, '\\x00', 'pending', 'transactional', '1 hour')",
            *k,
        )
        async with store:
            with pytest.raises(ClaimTimeout) as raised:
                async with store.transaction(acquire_timeout=5.0) as session:
                    await session.claim(k, b"f" * 32, retention_seconds=60.0, wait_seconds=5.0)
        assert not isinstance(raised.value, ClaimBusy | StoreError), raised.value
        assert isinstance(raised.value.__cause__, asyncpg.exceptions.QueryCanceledError)
        await tx.rollback()
    finally:
        await other.close()

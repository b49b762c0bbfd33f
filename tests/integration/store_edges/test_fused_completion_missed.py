"""A fast-path completion that matches no pending record (the handler deleted or changed the
record its transaction had claimed: a bug, a cleanup job run inside the request) is the store's
StoreError "completion matched no pending record", as on the ordinary path, not the raw
division by zero that the checked statement uses to abort before its COMMIT (fused.py
`_with_commit`: `_MISSED`)."""

from __future__ import annotations

import uuid

import asyncpg
import pytest

from idem_middleware import PostgresStore
from idem_middleware.errors import StoreError
from idem_middleware.store.base import Claimed, RecordKey, State, StoredResponse

_OK = StoredResponse(201, [], b"{}", None)


async def _claim(store: PostgresStore, key: RecordKey, delete_first: bool) -> None:
    async with store.transaction(acquire_timeout=5.0) as session:
        claimed = await session.claim(key, b"f" * 32, retention_seconds=60.0, wait_seconds=0.2)
        assert isinstance(claimed, Claimed)
        if delete_first:  # (the handler, on the connection it was given)
            await session.connection.execute(
                "DELETE FROM idem_requests WHERE idem_key = $1", key.key
            )
        await session.finish(State.SUCCEEDED, _OK)


async def test_a_fast_completion_that_matches_nothing_is_a_store_error(db_dsn: str) -> None:
    key = RecordKey("tenant-a", "POST /x", uuid.uuid4().hex)
    async with PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False) as store:
        await _claim(store, key, delete_first=False)
        conn = await asyncpg.connect(db_dsn)
        try:  # (expired: the next claim takes it over, a pending record completed by UPDATE)
            await conn.execute(
                "UPDATE idem_requests SET expires_at = now() - interval '1 second'"
                " WHERE idem_key = $1",
                key.key,
            )
        finally:
            await conn.close()
        with pytest.raises(StoreError, match="completion matched no pending record"):
            await _claim(store, key, delete_first=True)

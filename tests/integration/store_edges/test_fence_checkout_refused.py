"""A lease-mode fence (`store.fenced`) whose checkout the server refuses (a connection limit
reached, the database closed to connections after the claim): a StoreError (503, a blip to
retry), never the driver's error escaping as a 500 (fenced.Fencing.__aenter__'s
CHECKOUT_ERRORS)."""

from __future__ import annotations

import pytest

from idem_middleware import PostgresStore
from idem_middleware.errors import StoreError
from idem_middleware.store.base import Claimed, RecordKey
from tests.integration.test_server_states import REFUSALS, Own
from tests.integration.test_server_states import own as own  # the fixture


@pytest.mark.parametrize("refusal", list(REFUSALS))
async def test_a_fence_the_server_refuses_a_connection_is_a_store_error(
    own: Own, refusal: str
) -> None:
    refuse, take = REFUSALS[refusal]
    key = RecordKey("tenant-a", "POST /x", f"fence-{refusal}")
    async with PostgresStore(dsn=own.dsn, min_size=1, max_size=2, listen=False) as store:
        claimed = await store.claim_lease(
            key, b"f" * 32, retention_seconds=60.0, lease_seconds=30.0
        )
        assert isinstance(claimed, Claimed)
        await own.run(refuse)
        await store.pool.expire_connections()  # (the fence's checkout opens a new one)
        try:
            with pytest.raises(StoreError, match="no database connection"):
                async with store.fenced(key, claimed.generation):
                    pass
        finally:
            await own.run(take)
        async with store.fenced(key, claimed.generation) as fence:
            assert fence.connection is not None

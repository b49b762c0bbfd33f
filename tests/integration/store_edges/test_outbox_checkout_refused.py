"""The outbox's connection (a publisher's, `store.outbox_connection()`) when the server refuses
the pool a new connection, as test_server_states.py's REFUSALS do for requests: a StoreError (a
blip the publisher backs off from and retries), never the driver's own error (55000 "not
currently accepting connections" is no connection error of asyncpg's), then the connection
once the server takes connections again (runner.checkout)."""

from __future__ import annotations

import pytest

from idem_middleware import PostgresStore
from idem_middleware.errors import StoreError
from tests.integration.test_server_states import REFUSALS, Own
from tests.integration.test_server_states import own as own  # the fixture


@pytest.mark.parametrize("refusal", list(REFUSALS))
async def test_an_outbox_checkout_the_server_refuses_is_a_store_error(
    own: Own, refusal: str
) -> None:
    refuse, take = REFUSALS[refusal]
    async with PostgresStore(dsn=own.dsn, min_size=1, max_size=2, listen=False) as store:
        await own.run(refuse)
        await store.pool.expire_connections()  # (the next checkout opens a new one)
        try:
            with pytest.raises(StoreError, match="no database connection"):
                async with store.outbox_connection():
                    pass
        finally:
            await own.run(take)
        async with store.outbox_connection():
            pass

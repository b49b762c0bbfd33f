"""The statements of tokens.py and outbox.py run through `_run_any`: any error the server reports
for one (here a privilege revoked from the store's role) reaches their callers as the
library's StatementRefused, a StoreError, never as the driver's own error (the callers, the
CLI's `outbox stats` among them, expect no driver error)."""

from __future__ import annotations

import asyncpg
import pytest

from idem_middleware import PostgresStore
from idem_middleware.errors import StatementRefused
from idem_middleware.outbox import outbox_stats
from tests.integration.test_server_states import Own
from tests.integration.test_server_states import own as own  # the fixture


async def test_an_outbox_statement_the_server_refuses_is_a_statement_refused(own: Own) -> None:
    async with PostgresStore(dsn=own.dsn, min_size=1, max_size=2, listen=False) as store:
        async with store.pool.acquire() as conn:
            await conn.execute("REVOKE SELECT ON idem_outbox FROM CURRENT_USER")
        with pytest.raises(StatementRefused) as raised:
            await outbox_stats(store.pool)
        assert not isinstance(raised.value, asyncpg.PostgresError)
        assert isinstance(raised.value.__cause__, asyncpg.InsufficientPrivilegeError)

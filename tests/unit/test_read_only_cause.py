"""A completion refused as read-only with no connection left to ask whose doing it was (the
handler gave the claim's connection back) is the server's, a 503 for a retry later: not an
AttributeError from asking nothing."""

from __future__ import annotations

import asyncpg

from idem_middleware.errors import StoreError
from idem_middleware.store.postgres.refusing import read_only_cause


async def test_no_connection_to_ask_is_the_servers_read_only() -> None:
    error = asyncpg.exceptions.ReadOnlySQLTransactionError("cannot execute INSERT")
    judged = await read_only_cause(None, error)
    assert type(judged) is StoreError
    assert "takes no writes" in str(judged)

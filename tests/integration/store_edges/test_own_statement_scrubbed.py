"""An error the server reports for one of the store's own statements that the store does not
translate (a trigger's, a constraint's refusal of a lease-mode settlement) goes on without its
DETAIL or CONTEXT (runner.alone scrubs it): they quote the row refused (tenant, key, body), and
the error's text is logged with its traceback at ERROR (docs/security.md)."""

from __future__ import annotations

import asyncpg
import pytest

from idem_middleware import PostgresStore
from idem_middleware.errors import FencedSettlementRefused
from idem_middleware.store.base import Claimed, RecordKey, Settlement, State, StoredResponse
from tests.integration.test_server_states import Own
from tests.integration.test_server_states import own as own  # the fixture

_REFUSE = """
CREATE FUNCTION idem_test_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'refused by policy' USING DETAIL = 'row: ' || NEW.idem_key,
    ERRCODE = '23514'; END $$;
CREATE TRIGGER idem_test_refuse BEFORE UPDATE ON idem_requests
FOR EACH ROW EXECUTE FUNCTION idem_test_refuse();
"""


async def test_a_refused_settlement_goes_on_without_the_rows_detail(own: Own) -> None:
    key = RecordKey("tenant-a", "POST /x", "secret-key-value")
    async with PostgresStore(dsn=own.dsn, min_size=1, max_size=2, listen=False) as store:
        claimed = await store.claim_lease(
            key, b"f" * 32, retention_seconds=60.0, lease_seconds=30.0
        )
        assert isinstance(claimed, Claimed)
        async with store.pool.acquire() as conn:
            await conn.execute(_REFUSE)
        settlement = Settlement(State.SUCCEEDED, StoredResponse(201, [], b"body", None))
        with pytest.raises(FencedSettlementRefused) as raised:
            await store.settle(key, claimed.generation, State.PENDING, settlement)
    # (Refused in words, a StoreError: the driver's error escaped, the app's bare 500.)
    assert "a constraint or trigger on idem_requests refuses it" in str(raised.value)
    cause = raised.value.__cause__
    assert isinstance(cause, asyncpg.PostgresError)
    assert "secret-key-value" not in f"{raised.value} {cause}"
    assert getattr(cause, "detail", None) is None

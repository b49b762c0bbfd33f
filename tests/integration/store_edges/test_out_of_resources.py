"""A server out of resources (SQLSTATE class 53: a full disk, out of memory, too many
connections) while it runs one of the store's own statements: the request is answered
`503 store-unavailable` with Retry-After, as for sessions that take no writes, nothing is
committed, and the retry runs once when the server has room again (convert.UNAVAILABLE).
Raised here by a trigger with the server's own SQLSTATE for a full disk (53100)."""

from __future__ import annotations

import pytest

from idem_middleware import PostgresStore
from tests.apps import assert_replay_of, client
from tests.integration.test_server_states import (
    KEY,
    POLICIES,
    Own,
    assert_unavailable,
    counting_app,
)
from tests.integration.test_server_states import own as own  # the fixture

_FULL = """
CREATE FUNCTION idem_test_disk_full() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'could not extend file' USING ERRCODE = '53100'; END $$;
CREATE TRIGGER idem_test_disk_full BEFORE INSERT OR UPDATE ON idem_requests
FOR EACH ROW EXECUTE FUNCTION idem_test_disk_full();
"""


@pytest.mark.parametrize("mode", list(POLICIES))
async def test_a_server_out_of_resources_answers_503_and_recovers(own: Own, mode: str) -> None:
    """Every write of the store's refused with 53100: a 503 (it would be a 500, "the database
    refused the claim", were class 53 not the store's trouble), then the request runs once."""
    async with PostgresStore(dsn=own.dsn, min_size=1, max_size=2, listen=False) as store:
        app, runs = counting_app(store, mode)
        async with store.pool.acquire() as conn:
            await conn.execute(_FULL)
        headers = {"Idempotency-Key": "read-only"}
        async with client(app) as c:
            for _ in range(2):
                assert_unavailable(await c.post("/charges", json={}, headers=headers))
            assert await store.get(KEY) is None
            async with store.pool.acquire() as conn:
                await conn.execute("DROP TRIGGER idem_test_disk_full ON idem_requests")
            refused = len(runs)
            first = await c.post("/charges", json={}, headers=headers)
            assert first.status_code == 201, first.text
            assert_replay_of(await c.post("/charges", json={}, headers=headers), first)
        assert len(runs) == refused + 1

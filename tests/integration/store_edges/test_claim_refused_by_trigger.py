"""A transactional claim the server refuses for a reason no retry clears (a trigger, a policy,
a privilege revoked since the store opened), on the ordinary path (its claim inserts the
pending record): the library's ClaimRefused, answered as a problem document and logged without
the refused row's DETAIL; the handler never runs (sessions.PgTransaction._claim's
`claim_refused`). It escaped as the driver's error, a bare 500."""

from __future__ import annotations

import logging

import pytest

from idem_middleware import PostgresStore
from tests.apps import client
from tests.integration.test_server_states import Own, counting_app
from tests.integration.test_server_states import own as own  # the fixture

_REFUSE = """
CREATE FUNCTION idem_test_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'refused by policy' USING DETAIL = 'row: ' || NEW.idem_key; END $$;
CREATE TRIGGER idem_test_refuse BEFORE INSERT ON idem_requests
FOR EACH ROW EXECUTE FUNCTION idem_test_refuse();
"""


async def test_a_claim_a_trigger_refuses_is_a_problem_document(
    own: Own, caplog: pytest.LogCaptureFixture
) -> None:
    store = PostgresStore(dsn=own.dsn, min_size=1, max_size=2, listen=False, fast_path=False)
    caplog.set_level(logging.WARNING, logger="idem_middleware")
    async with store:
        async with store.pool.acquire() as conn:
            await conn.execute(_REFUSE)
        app, runs = counting_app(store, "transactional")
        async with client(app) as c:
            r = await c.post("/charges", json={}, headers={"Idempotency-Key": "secret-key-1"})
    assert r.status_code == 500
    assert r.headers["content-type"].startswith("application/problem+json"), r.text
    assert runs == []
    assert "the database refused the claim" in caplog.text
    assert "row: secret-key-1" not in caplog.text

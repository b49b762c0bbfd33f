"""A transactional handler's write whose deferred constraint fails at COMMIT, on the ordinary
path (the fast path off, or a body past its limit: the outcome is written, then COMMIT on its
own): nothing committed, the key free, and the failure logged for what it is ("broke a deferred
constraint", sessions.PgTransaction._commit's `refused`), as test_fused_reset.py pins for the
fused COMMIT; never the driver's IntegrityError with its DETAIL."""

from __future__ import annotations

import logging

import pytest

from idem_middleware import Mode, PostgresStore
from tests.apps import client, key
from tests.integration.test_fused_reset import _app, _children
from tests.integration.test_fused_reset import tables as tables  # the fixture


@pytest.mark.usefixtures("tables")
async def test_a_deferred_constraint_failing_at_an_ordinary_commit_is_refused_in_words(
    db_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=1, listen=False, fast_path=False)
    caplog.set_level(logging.WARNING, logger="idem_middleware")
    async with store, client(_app(store, Mode.TRANSACTIONAL)) as c:
        r = await c.post("/orphan", json={}, headers=key("orphan-ordinary"))
        async with store.pool.acquire() as conn:
            recorded = await conn.fetchval(
                "SELECT state FROM idem_requests WHERE idem_key = 'orphan-ordinary'"
            )
    assert r.status_code >= 500
    assert recorded is None  # the key is free
    assert await _children(db_dsn) == 0
    assert "broke a deferred constraint" in caplog.text
    assert "Key (parent)=(999)" not in caplog.text  # the DETAIL quoting the row is dropped

"""A fenced settlement the database refuses at its COMMIT (a deferred foreign key of the
handler's write), on the ordinary path (the fast path off): the record is `unknown` at once,
as test_fused_reset.py pins for the fused settlement (fenced.Fencing.settle's
`refused(exc, fenced=True)`: FencedSettlementRefused, never the transactional "the key is
free" in its logged words); what the handler did outside the database may have happened."""

from __future__ import annotations

import logging

import pytest

from idem_middleware import Mode, PostgresStore
from tests.apps import client, key
from tests.integration.test_fused_reset import _app, _children
from tests.integration.test_fused_reset import tables as tables  # the fixture


@pytest.mark.usefixtures("tables")
async def test_an_ordinary_fenced_settlement_refused_leaves_the_record_unknown(
    db_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="idem_middleware")
    k = key("orphan-unknown-ordinary")
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False, fast_path=False)
    async with store, client(_app(store, Mode.LEASE)) as c:
        first = await c.post("/orphan", json={}, headers=k)
        async with store.pool.acquire() as conn:
            recorded = await conn.fetchval(
                "SELECT state FROM idem_requests WHERE idem_key = $1", k["idempotency-key"]
            )
        again = await c.post("/orphan", json={}, headers=k)
    assert first.status_code >= 500
    assert recorded == "unknown"
    assert again.json()["type"].endswith(":outcome-unknown"), again.text
    assert await _children(db_dsn) == 0
    assert "the record is unknown" in caplog.text
    assert "the key is free" not in caplog.text

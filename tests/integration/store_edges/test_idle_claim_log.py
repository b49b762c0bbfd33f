"""The 503 of a transactional claim whose session the server ended for idling in its
transaction names `idle_in_transaction_session_timeout` in its own log line (convert.
claim_connection_gone), not only in the INFO line the store's open logs about the setting:
test_server_states.py's check read the whole of caplog, which the open's line satisfies. Both
when the handler's next statement meets the lost connection (`lost`), and when the handler
returns without one and the completion meets it (`finish`)."""

from __future__ import annotations

import asyncio
import logging

import asyncpg
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import PostgresStore, get_context
from tests.apps import client, one_route_app
from tests.integration.test_server_states import POLICIES, Own, assert_unavailable
from tests.integration.test_server_states import own as own  # the fixture


@pytest.mark.parametrize("then", ["statement", "return"])
async def test_the_503_of_a_claim_ended_for_idling_names_the_timeout(
    own: Own, caplog: pytest.LogCaptureFixture, then: str
) -> None:
    await own.run("ALTER DATABASE \"{name}\" SET idle_in_transaction_session_timeout = '100ms'")
    watcher = await asyncpg.connect(own.admin)

    async def charge(request: Request) -> Response:
        conn = get_context(request).connection
        assert conn is not None
        pid = conn.get_server_pid()
        for _ in range(400):  # until the server ended the idle session (bounded)
            if not await watcher.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid
            ):
                break
            await asyncio.sleep(0.025)
        else:
            raise AssertionError("the server did not end the idle session")
        if then == "statement":
            await conn.execute("SELECT 1")
        return JSONResponse({}, status_code=201)

    try:
        async with PostgresStore(dsn=own.dsn, min_size=1, max_size=2, listen=False) as store:
            app = one_route_app(
                "/charges",
                charge,
                store=store,
                policies={"POST /charges": POLICIES["transactional"]},
            )
            async with client(app) as c:
                caplog.clear()  # (the open's INFO line names the setting too)
                with caplog.at_level(logging.WARNING, logger="idem_middleware"):
                    assert_unavailable(
                        await c.post("/charges", json={}, headers={"Idempotency-Key": "idle"})
                    )
                said = [r.getMessage() + str(r.exc_info and r.exc_info[1]) for r in caplog.records]
                assert any("idle_in_transaction_session_timeout" in s for s in said), said
    finally:
        await watcher.close()

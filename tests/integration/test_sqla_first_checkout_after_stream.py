"""A claim session first used by a stream after its first byte (no checkout before it): the
claim's connection was given back already, so the checkout itself fails with the released
connection's InterfaceError, saying so; nothing is written. (Before, the pool went on with no
connection at all, and the session failed on an attribute of None, naming nothing.)"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from sqlalchemy import text

from idem_middleware.fastapi import install
from idem_middleware.sqla import open_claim_session
from idem_middleware.store.postgres import PostgresStore
from tests.integration.test_sqla_after_stream import one_connection  # noqa: F401

INSERT = text("INSERT INTO test_sqla_orders (id, tenant, amount) VALUES ('late', 't', 1)")


async def test_a_session_first_used_after_the_first_byte_is_refused_as_released(
    one_connection: PostgresStore,  # noqa: F811
    pool: asyncpg.Pool[Any],
) -> None:
    seen: list[BaseException] = []
    api = FastAPI()

    @api.post("/events")
    async def events(request: Request) -> StreamingResponse:
        async def stream() -> AsyncIterator[bytes]:
            yield b"data: started\n\n"
            try:
                async with open_claim_session(request) as session:
                    await session.execute(INSERT)
            except Exception as error:  # what the test looks at
                seen.append(error)
            yield b"data: done\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    install(api, store=one_connection, tenant_resolver=lambda scope: "t")
    transport = httpx.ASGITransport(app=api)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        answer = await http.post("/events", headers={"Idempotency-Key": "k"})
    assert answer.status_code == 200, answer.text
    assert len(seen) == 1
    assert "released back to the pool" in str(seen[0]), repr(seen[0])
    assert await pool.fetch("SELECT id FROM test_sqla_orders") == []

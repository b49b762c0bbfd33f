"""A webhook send the receiver did not accept is a failed attempt, never a delivery: any answer
but a 2xx, a 3xx redirect included (webhook_sender's docstring: "Any 2xx is delivered; anything
else is retried"). Marked sent, the event would be lost: it is never sent again."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from idem_middleware.outbox import Publisher, add, webhook_sender

pytestmark = pytest.mark.db_routes("pgbouncer")


async def _one_event(pool: Any) -> str:
    async with pool.acquire() as conn:
        return await add(conn, "t", {"x": 1})


async def _row(pool: Any) -> Any:
    return await pool.fetchrow("SELECT sent_at, attempts, last_error FROM idem_outbox")


@pytest.mark.parametrize("status", [199, 302, 304, 400, 503])
async def test_a_webhook_answered_other_than_2xx_is_not_delivered(pool: Any, status: int) -> None:
    await _one_event(pool)
    seen: list[httpx.Request] = []

    def receiver(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(status, headers={"location": "http://127.0.0.1:1/elsewhere"})

    async with httpx.AsyncClient(transport=httpx.MockTransport(receiver)) as client:
        send = webhook_sender(client, "http://127.0.0.1:1/events")
        report = await Publisher(pool, send, base_backoff_seconds=60).publish_batch()
    assert len(seen) == 1
    assert (report.sent, report.failed) == (0, 1)
    row = await _row(pool)
    assert row["sent_at"] is None
    assert f"the receiver answered {status}" in row["last_error"]


@pytest.mark.parametrize("status", [200, 202, 204, 299])
async def test_a_webhook_answered_2xx_is_delivered(pool: Any, status: int) -> None:
    await _one_event(pool)

    async with httpx.AsyncClient(
        transport=httpx.MockTransport(lambda request: httpx.Response(status))
    ) as client:
        send = webhook_sender(client, "http://127.0.0.1:1/events")
        report = await Publisher(pool, send).publish_batch()
    assert (report.sent, report.failed) == (1, 0)
    assert (await _row(pool))["sent_at"] is not None

"""What a publisher's run reports and how it idles. An idle run waits `idle_seconds` between
batches that found nothing due (it does not poll the database in a loop); and a send whose
`sent` mark the database refuses is not counted as sent (the event stays unsent, to be sent
again once its reservation lapses: `outbox publish` would otherwise report it delivered)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from idem_middleware.outbox import OutboxEvent, Publisher, add


async def test_an_idle_run_waits_between_batches_that_found_nothing(pool: Any) -> None:
    await pool.execute("DELETE FROM idem_outbox")

    async def never(event: OutboxEvent) -> None:
        raise AssertionError("nothing is due")

    loop = asyncio.get_running_loop()
    started = loop.time()
    report = await asyncio.wait_for(Publisher(pool, never).run(batches=3, idle_seconds=0.25), 10)
    # Two idle waits (after the first and second batches; none after the last).
    assert loop.time() - started >= 0.45
    assert (report.sent, report.failed) == (0, 0)


async def test_a_send_whose_mark_is_refused_is_not_counted_as_sent(
    pool: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async with pool.acquire() as conn:
        event_id = await add(conn, "t", {"x": 1})
    await pool.execute(
        """
        CREATE FUNCTION pin_refuse_sent() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.sent_at IS NOT NULL THEN
                RAISE EXCEPTION 'refused by a trigger' USING ERRCODE = 'check_violation';
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER pin_refuse_sent BEFORE UPDATE ON idem_outbox
            FOR EACH ROW EXECUTE FUNCTION pin_refuse_sent();
        """
    )
    sent: list[str] = []

    async def accepts(event: OutboxEvent) -> None:
        sent.append(event.event_id)

    try:
        report = await Publisher(pool, accepts).publish_batch()
    finally:
        await pool.execute(
            "DROP TRIGGER pin_refuse_sent ON idem_outbox; DROP FUNCTION pin_refuse_sent()"
        )
    assert sent == [event_id]
    assert (report.sent, report.failed) == (0, 0)
    assert await pool.fetchval("SELECT sent_at FROM idem_outbox") is None
    assert "recording an outbox send's result failed" in caplog.text

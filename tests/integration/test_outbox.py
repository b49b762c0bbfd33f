"""The transactional outbox on real PostgreSQL: written with the business transaction, published
at least once, applied once by a deduplicating consumer."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import pytest

from idem_middleware import Policy, PostgresStore, get_context
from idem_middleware.errors import EventConflict, StatementRefused, StoreError
from idem_middleware.outbox import (
    OutboxEvent,
    Publisher,
    add,
    consume_once,
    list_events,
    outbox_stats,
    purge_sent,
    requeue,
    webhook_sender,
)
from tests.evidence import record

pytestmark = pytest.mark.db_routes("pgbouncer")

CONSUMER_TABLE = (
    "CREATE TABLE IF NOT EXISTS test_consumer_effects (event_id text, applied_at timestamptz "
    "DEFAULT now())"
)


@pytest.fixture
async def consumer_table(pool: Any) -> None:
    await pool.execute(CONSUMER_TABLE)
    await pool.execute("TRUNCATE test_consumer_effects")


def consumer(pool: Any, name: str = "ledger") -> Any:
    """A deduplicating consumer: applies each event once, in its own transaction."""

    async def apply(event: OutboxEvent) -> bool:
        async with pool.acquire() as conn, conn.transaction():
            if await consume_once(conn, name, event.event_id):
                await conn.execute(
                    "INSERT INTO test_consumer_effects (event_id) VALUES ($1)", event.event_id
                )
        return True

    return apply


async def test_an_event_exists_iff_its_transaction_committed(pool: Any) -> None:
    async def failing_business_write(conn: Any) -> None:
        async with conn.transaction():
            await add(conn, "credit", {"amount": 6})
            raise RuntimeError("the business write failed")

    async with pool.acquire() as conn:
        async with conn.transaction():
            committed = await add(conn, "credit", {"amount": 5})
        with pytest.raises(RuntimeError):
            await failing_business_write(conn)
    ids = [r["event_id"] for r in await pool.fetch("SELECT event_id FROM idem_outbox")]
    assert ids == [committed]


async def test_an_event_added_again_under_its_id_is_kept_once(pool: Any) -> None:
    """A deterministic event id added again, by a later transaction or the same one, with the
    same tenant, topic and payload is a no-op (the event is sent once, and the caller's
    transaction carries on); with anything else it is EventConflict, and the first event stands."""
    async with pool.acquire() as conn:
        async with conn.transaction():
            await add(conn, "credit", {"amount": 5, "to": "acc-1"}, event_id="e1", tenant="t")
            await add(conn, "credit", {"to": "acc-1", "amount": 5}, event_id="e1", tenant="t")
        async with conn.transaction():
            assert (
                await add(conn, "credit", {"amount": 5, "to": "acc-1"}, event_id="e1", tenant="t")
                == "e1"
            )
            await conn.execute("SELECT 1")  # the transaction is still usable
        for topic, payload, tenant in [
            ("credit", {"amount": 6, "to": "acc-1"}, "t"),
            ("debit", {"amount": 5, "to": "acc-1"}, "t"),
            ("credit", {"amount": 5, "to": "acc-1"}, "other"),
            ("credit", {"amount": 5, "to": "acc-1"}, None),
        ]:
            async with conn.transaction():
                with pytest.raises(EventConflict):
                    await add(conn, topic, payload, event_id="e1", tenant=tenant)
                await conn.execute("SELECT 1")  # still usable: the caller decides
    rows = await pool.fetch("SELECT event_id, tenant, topic, payload FROM idem_outbox")
    assert [(r["event_id"], r["tenant"], r["topic"]) for r in rows] == [("e1", "t", "credit")]
    assert orjson.loads(rows[0]["payload"]) == {"amount": 5, "to": "acc-1"}


async def test_a_connection_with_a_jsonb_codec_stores_the_payload_as_its_json(
    pool: Any,
) -> None:
    """Found by probing: with asyncpg's usual jsonb codec on the connection
    (`set_type_codec("jsonb", encoder=json.dumps, ...)`), the payload's JSON text was encoded
    again, stored as a JSON string (`"{\"amount\":5}"`) and published so; and the same event
    added from a connection without it was an EventConflict. The text goes as text now."""
    import json

    async with pool.acquire() as conn:
        await conn.set_type_codec(
            "jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog"
        )
        try:
            async with conn.transaction():
                await add(conn, "credit", {"amount": 5}, event_id="e1", tenant="t")
        finally:
            await conn.reset_type_codec("jsonb", schema="pg_catalog")
    async with pool.acquire() as plain, plain.transaction():
        assert await add(plain, "credit", {"amount": 5}, event_id="e1", tenant="t") == "e1"
    row = await pool.fetchrow(
        "SELECT jsonb_typeof(payload) AS kind, payload::text AS text FROM idem_outbox"
    )
    assert row["kind"] == "object"
    assert orjson.loads(row["text"]) == {"amount": 5}


async def test_an_event_purged_while_it_is_added_again_is_added_afresh(pool: Any) -> None:
    """`add` of a sent event's id finds it (nothing written), then compares it: a purge in
    between left nothing to compare, and `add` raised EventConflict for the very same event.
    Found by probing. It is added again, as after any purge."""
    await pool.execute(
        "INSERT INTO idem_outbox (event_id, topic, payload, sent_at)"
        " VALUES ('e9', 'credit', '{\"amount\": 5}', now() - interval '8 days')"
    )

    class PurgedBetween:
        """The caller's connection; the purge runs before its second statement."""

        def __init__(self, conn: Any) -> None:
            self.conn, self.statements = conn, 0

        async def fetchval(self, *args: Any, **kwargs: Any) -> Any:
            self.statements += 1
            if self.statements == 2:
                assert await purge_sent(pool, older_than_seconds=7 * 86400) == 1
            return await self.conn.fetchval(*args, **kwargs)

    async with pool.acquire() as conn, conn.transaction():
        added = await add(PurgedBetween(conn), "credit", {"amount": 5}, event_id="e9")
    assert added == "e9"
    row = await pool.fetchrow("SELECT sent_at, payload FROM idem_outbox WHERE event_id = 'e9'")
    assert row is not None
    assert row["sent_at"] is None  # a fresh event, to be sent
    assert orjson.loads(row["payload"]) == {"amount": 5}


async def test_an_event_added_by_two_transactions_at_once_is_kept_once(pool: Any) -> None:
    """The second waits for the first to commit (the primary key), then finds the same event."""
    async with pool.acquire() as first, pool.acquire() as second:
        tx1 = first.transaction()
        await tx1.start()
        await add(first, "credit", {"amount": 5}, event_id="e2")
        tx2 = second.transaction()
        await tx2.start()
        adding = asyncio.ensure_future(add(second, "credit", {"amount": 5}, event_id="e2"))
        await tx1.commit()
        assert await asyncio.wait_for(adding, 5) == "e2"
        await tx2.commit()
    assert await pool.fetchval("SELECT count(*) FROM idem_outbox") == 1


async def test_events_commit_with_the_idempotent_handler_or_not_at_all(
    pg_store: PostgresStore, pool: Any
) -> None:
    """The handler adds its event on the claim's connection: a replay adds nothing, a
    rolled-back request (5xx) leaves no event."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from idem_middleware import IdempotencyMiddleware
    from tests.apps import client

    async def pay(request: Request) -> JSONResponse:
        ctx = get_context(request)
        body = await request.json()
        await add(ctx.connection, "paid", body, tenant=ctx.tenant)
        return JSONResponse(body, status_code=int(request.query_params.get("status", "201")))

    app = Starlette(
        routes=[Route("/pay", pay, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=pg_store,
                default_policy=Policy(allow_anonymous=True),
            )
        ],
    )
    async with client(app, token=None) as c:
        await c.post("/pay", json={"n": 1}, headers={"idempotency-key": "a"})
        await c.post("/pay", json={"n": 1}, headers={"idempotency-key": "a"})  # replay
        failed = await c.post("/pay?status=503", json={"n": 2}, headers={"idempotency-key": "b"})
    assert failed.status_code == 503
    payloads = [r["payload"] for r in await pool.fetch("SELECT payload::text FROM idem_outbox")]
    assert payloads == ['{"n": 1}']


async def test_two_publishers_never_send_one_event_at_the_same_time(
    pool: Any, consumer_table: None
) -> None:
    async with pool.acquire() as conn:
        for i in range(40):
            await add(conn, "t", {"i": i})
    in_flight: set[str] = set()
    overlaps: list[str] = []
    sends: list[str] = []

    async def slow_sender(event: OutboxEvent) -> bool:
        if event.event_id in in_flight:
            overlaps.append(event.event_id)
        in_flight.add(event.event_id)
        await asyncio.sleep(0.005)
        sends.append(event.event_id)
        in_flight.discard(event.event_id)
        return True

    publishers = [Publisher(pool, slow_sender, batch_size=5) for _ in range(3)]
    await asyncio.gather(*(p.run(batches=12, idle_seconds=0.01) for p in publishers))
    assert overlaps == []
    assert len(sends) == len(set(sends)) == 40
    assert await pool.fetchval("SELECT count(*) FROM idem_outbox WHERE sent_at IS NULL") == 0


async def test_a_failing_sender_backs_off_then_parks_the_event(pool: Any) -> None:
    async with pool.acquire() as conn:
        event_id = await add(conn, "t", {"x": 1})
    attempts = 0

    async def broken(event: OutboxEvent) -> bool:
        nonlocal attempts
        attempts += 1
        raise ConnectionError("receiver down")

    publisher = Publisher(pool, broken, max_attempts=3, base_backoff_seconds=0.0)
    for _ in range(5):
        await publisher.publish_batch()
    assert attempts == 3  # parked after 3: no fourth try
    row = await pool.fetchrow("SELECT attempts, parked_at, last_error FROM idem_outbox")
    assert row["attempts"] == 3
    assert row["parked_at"] is not None
    assert "receiver down" in row["last_error"]
    parked = await list_events(pool, parked_only=True)
    assert [e["event_id"] for e in parked] == [event_id]
    # Backoff: a failure schedules the next attempt later, growing per attempt.
    await pool.execute("TRUNCATE idem_outbox")
    async with pool.acquire() as conn:
        await add(conn, "t", {"x": 2})
    patient = Publisher(pool, broken, max_attempts=3, base_backoff_seconds=30.0)
    await patient.publish_batch()
    await patient.publish_batch()  # not due yet: not sent again
    assert attempts == 4
    delay = await pool.fetchval(
        "SELECT EXTRACT(EPOCH FROM next_attempt_at - now()) FROM idem_outbox"
    )
    assert 25 < delay <= 30
    assert patient.backoff(0) < patient.backoff(1) < patient.backoff(2)


async def test_publisher_killed_between_sending_and_marking(
    db_dsn: str, pool: Any, consumer_table: None, tmp_path: Path
) -> None:
    """A publisher process sends an event (the consumer applies it), then dies before marking it
    sent. Once its reservation lapses the next publisher sends it again, the dead publisher's
    attempt counted; the consumer applies it once."""
    async with pool.acquire() as conn:
        event_id = await add(conn, "payout", {"amount": 7})
    sent_flag = tmp_path / "sent"
    script = tmp_path / "publisher.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import asyncio, pathlib, asyncpg
            from idem_middleware.outbox import Publisher, consume_once

            async def main():
                pool = await asyncpg.create_pool({db_dsn!r}, min_size=1, max_size=2)
                async def send(event):
                    async with pool.acquire() as conn, conn.transaction():
                        if await consume_once(conn, "ledger", event.event_id):
                            await conn.execute(
                                "INSERT INTO test_consumer_effects (event_id) VALUES ($1)",
                                event.event_id,
                            )
                    pathlib.Path({str(sent_flag)!r}).write_text("sent")
                    await asyncio.sleep(60)  # killed here: sent, never marked
                    return True
                publisher = Publisher(
                    pool, send, send_timeout_seconds=2, reservation_margin_seconds=0.5
                )
                await publisher.publish_batch()

            asyncio.run(main())
            """
        )
    )
    proc = subprocess.Popen(  # noqa: ASYNC220 - a process to SIGKILL, not to await
        [sys.executable, str(script)], start_new_session=True
    )
    try:
        for _ in range(300):
            if sent_flag.exists():
                break
            await asyncio.sleep(0.05)
        assert sent_flag.exists(), "the first publisher never sent"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    deliveries = 1
    redelivered = 0

    async def counting(event: OutboxEvent) -> bool:
        nonlocal deliveries, redelivered
        deliveries += 1
        redelivered += 1
        return await consumer(pool)(event)

    publisher = Publisher(pool, counting)
    early = await publisher.publish_batch()
    assert early.sent + early.failed == 0  # still reserved by the dead publisher
    report = early
    for _ in range(100):  # bounded: the reservation (2.5 s) lapses
        await asyncio.sleep(0.05)
        report = await publisher.publish_batch()
        if report.sent:
            break
    applied = await pool.fetchval("SELECT count(*) FROM test_consumer_effects")
    assert (report.sent, deliveries, redelivered, applied) == (1, 2, 1, 1)
    row = await pool.fetchrow("SELECT sent_at IS NOT NULL AS sent, attempts FROM idem_outbox")
    assert dict(row) == {"sent": True, "attempts": 2}  # the killed attempt counted
    assert await pool.fetchval("SELECT count(*) FROM idem_inbox WHERE event_id = $1", event_id) == 1
    record(
        "outbox: publisher killed between send and mark",
        requests=deliveries,
        duplicate_effects=applied - 1,
        lost_outcomes=0,
        stuck_keys=0,
    )


class PublisherDied(BaseException):
    """What a sender raising this looks like to the outbox: the process stopped mid-send."""


async def test_an_event_no_publisher_finishes_sending_is_parked(pool: Any) -> None:
    """An event whose send kills the publisher every time (a crash, an OOM kill) is not retried
    forever: each death counts as an attempt, and it is parked after `max_attempts`."""
    async with pool.acquire() as conn:
        event_id = await add(conn, "t", {"poison": True})
    deaths = 0

    async def fatal(event: OutboxEvent) -> bool:
        nonlocal deaths
        deaths += 1
        raise PublisherDied

    publisher = Publisher(
        pool, fatal, max_attempts=3, send_timeout_seconds=0.05, reservation_margin_seconds=0.01
    )
    parked = 0
    for _ in range(50):  # bounded
        with contextlib.suppress(PublisherDied):
            parked += (await publisher.publish_batch()).parked
        if parked:
            break
        await asyncio.sleep(0.06)  # the dead attempt's reservation lapses
    assert (deaths, parked) == (3, 1)
    row = await pool.fetchrow("SELECT attempts, parked_at, last_error FROM idem_outbox")
    assert row["attempts"] == 3
    assert row["parked_at"] is not None
    assert "no publisher finished sending it" in row["last_error"]
    assert [e["event_id"] for e in await list_events(pool, parked_only=True)] == [event_id]


async def test_no_transaction_is_open_while_a_publisher_sends(pool: Any) -> None:
    """The reservation is committed before the send: a slow receiver holds no transaction (no
    row locks, no snapshot holding back vacuum), and others see the event reserved."""
    async with pool.acquire() as conn:
        await add(conn, "t", {"x": 1})
    seen: list[tuple[int, int]] = []

    async def observing(event: OutboxEvent) -> bool:
        open_transactions = await pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND state LIKE 'idle in transaction%'"
        )
        attempts = await pool.fetchval("SELECT attempts FROM idem_outbox")
        seen.append((open_transactions, attempts))
        return True

    report = await Publisher(pool, observing).publish_batch()
    assert report.sent == 1
    assert seen == [(0, 1)]


async def test_the_publisher_survives_a_database_outage(pool: Any) -> None:
    async with pool.acquire() as conn:
        await add(conn, "t", {"x": 1})
    sent: list[str] = []

    async def sender(event: OutboxEvent) -> bool:
        sent.append(event.event_id)
        return True

    publisher = Publisher(pool, sender, base_backoff_seconds=0.01)
    real = publisher.publish_batch
    calls = 0

    async def flaky(**options: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls <= 2:
            raise ConnectionError("the database restarted")
        return await real(**options)

    publisher.publish_batch = flaky  # type: ignore[method-assign]
    report = await asyncio.wait_for(publisher.run(batches=3, idle_seconds=0.01), 10)
    assert calls == 3
    assert report.sent == 1
    assert len(sent) == 1


async def test_a_stopped_publisher_reserves_no_further_event(pool: Any) -> None:
    """`stop` set during a send ends the batch after that send: the other due events stay
    unreserved, their attempts uncounted. The batch went on to `batch_size` events (50 sends of
    up to 10 s each after a SIGTERM to `outbox publish`)."""
    async with pool.acquire() as conn:
        for i in range(5):
            await add(conn, "t", {"i": i})
    stop = asyncio.Event()
    sent: list[Any] = []

    async def stopping(event: OutboxEvent) -> bool:
        sent.append(event.payload)
        stop.set()  # (SIGTERM arrives while this event is being sent)
        return True

    report = await asyncio.wait_for(Publisher(pool, stopping).run(stop=stop), 30)
    assert (report.sent, len(sent)) == (1, 1)
    counts = await pool.fetchrow(
        "SELECT count(*) FILTER (WHERE sent_at IS NULL AND attempts = 0) AS untouched,"
        " count(*) FILTER (WHERE sent_at IS NOT NULL) AS sent FROM idem_outbox"
    )
    assert dict(counts) == {"untouched": 4, "sent": 1}


async def test_an_event_whose_payload_cannot_be_decoded_fails_alone(pool: Any) -> None:
    """A row not written by `add` (a trigger, hand-written SQL) whose number no float holds:
    its send fails with an error saying so, backs off and is parked in the end, and the events
    after it in the batch are sent. orjson's error ended the batch, nothing sent while it was
    first in line, and it was parked as one "no publisher finished sending"."""
    await pool.execute(
        "INSERT INTO idem_outbox (event_id, topic, payload, next_attempt_at)"
        " VALUES ('huge', 't', '{\"n\": 1e400}', now() - interval '1 hour')"
    )
    async with pool.acquire() as conn:
        for i in range(3):
            await add(conn, "t", {"i": i})
    sent: list[Any] = []

    async def sender(event: OutboxEvent) -> bool:
        sent.append(event.payload)
        return True

    publisher = Publisher(pool, sender, max_attempts=1)
    report = await publisher.publish_batch()
    assert (report.sent, report.failed, report.parked) == (3, 1, 1)
    assert sorted(p["i"] for p in sent) == [0, 1, 2]
    row = await pool.fetchrow(
        "SELECT parked_at, last_error FROM idem_outbox WHERE event_id = 'huge'"
    )
    assert row["parked_at"] is not None
    assert row["last_error"].startswith("the payload cannot be decoded")


async def test_the_outbox_tools_raise_the_librarys_errors(db_dsn: str, pool: Any) -> None:
    """A pool that is gone is a StoreError from every tool, and a statement the database refuses
    is a StatementRefused: never asyncpg's own exceptions."""
    gone = await asyncpg.create_pool(db_dsn, min_size=1, max_size=1)
    await gone.close()
    for call in (
        lambda: outbox_stats(gone),
        lambda: list_events(gone),
        lambda: requeue(gone, ["e"]),
        lambda: purge_sent(gone),
        lambda: Publisher(gone, _never).publish_batch(),
    ):
        with pytest.raises(StoreError):
            await call()
    await pool.execute(
        "CREATE FUNCTION test_refuse_requeue() RETURNS trigger LANGUAGE plpgsql AS $$"
        " BEGIN RAISE EXCEPTION 'refused by the test'; END $$;"
        "CREATE TRIGGER test_refuse_requeue BEFORE UPDATE ON idem_outbox"
        " FOR EACH ROW EXECUTE FUNCTION test_refuse_requeue();"
        "INSERT INTO idem_outbox (event_id, topic, payload, parked_at)"
        " VALUES ('parked', 't', '{}', now())"
    )
    try:
        with pytest.raises(StatementRefused, match="refused by the test"):
            await requeue(pool, ["parked"])
    finally:
        await pool.execute(
            "DROP TRIGGER test_refuse_requeue ON idem_outbox; DROP FUNCTION test_refuse_requeue();"
            "TRUNCATE idem_outbox"
        )


async def _never(event: OutboxEvent) -> bool:
    raise AssertionError("nothing is sent")


def test_the_backoff_of_any_attempt_is_a_number_within_its_cap(pool: Any) -> None:
    """Found by probing: from the 1025th attempt, 2**attempts was no float (OverflowError), and
    the batch died without recording the failure."""
    publisher = Publisher(pool, _never_sent, max_attempts=5000, max_backoff_seconds=300.0)
    assert publisher.backoff(0) == 1.0
    assert publisher.backoff(1024) == publisher.backoff(10**6) == 300.0


async def _never_sent(event: Any) -> None:
    raise AssertionError("not sent")  # pragma: no cover


@pytest.mark.parametrize(
    ("topic", "payload", "options", "error"),
    [
        ("t", {"memo": "a\x00b"}, {}, ValueError),
        ("t", {"a\x00": 1}, {}, ValueError),
        ("t", {"amount": float("nan")}, {}, ValueError),
        ("t", [float("-inf")], {}, ValueError),
        ("t", 1, {"event_id": ""}, ValueError),
        ("t", 1, {"event_id": "e\x00"}, ValueError),
        ("t", 1, {"event_id": "e" * 1025}, ValueError),
        ("t", 1, {"event_id": 5}, TypeError),
        ("t\x00", 1, {}, ValueError),
        (None, 1, {}, TypeError),
        ("t", 1, {"tenant": "a\x00"}, ValueError),
        ("t", {1, 2}, {}, TypeError),
    ],
)
async def test_an_event_the_database_would_refuse_or_json_change_is_refused_at_add(
    pool: Any, topic: Any, payload: Any, options: dict[str, Any], error: type[Exception]
) -> None:
    """Found by probing: a NUL (in the payload, the id, the topic or the tenant), a missing
    topic or an over-long id reached the database, whose refusal aborted the caller's transaction
    and its business write with it; NaN and the infinities were stored as null; an empty
    event_id was silently replaced by a random one (two adds, two events). Each is refused
    before any statement, and the caller's transaction carries on."""
    async with pool.acquire() as conn, conn.transaction():
        with pytest.raises(error):
            await add(conn, topic, payload, **options)
        await add(conn, "t", {"memo": "\\u0000 as text"}, event_id="fine")  # still usable
    rows = await pool.fetch("SELECT event_id, payload FROM idem_outbox")
    assert [(r["event_id"], orjson.loads(r["payload"])) for r in rows] == [
        ("fine", {"memo": "\\u0000 as text"})
    ]


@pytest.mark.parametrize(
    "options",
    [
        {"send_timeout_seconds": float("nan")},
        {"send_timeout_seconds": float("inf")},
        {"send_timeout_seconds": 1e20},
        {"reservation_margin_seconds": float("nan")},
        {"reservation_margin_seconds": 0},  # (two publishers overlapped on one event)
        {"base_backoff_seconds": -5},
        {"base_backoff_seconds": float("nan")},
        {"max_backoff_seconds": float("inf")},
        {"max_backoff_seconds": -1},
        {"batch_size": 2.5},
        {"max_attempts": True},
        {"max_attempts": 2**31},
    ],
)
def test_a_publisher_whose_options_cannot_work_is_refused_when_made(
    pool: Any, options: dict[str, Any]
) -> None:
    """Found by probing: a send timeout or margin the database cannot add to now() (NaN, an
    infinity, 1e20 s) or an attempt cap over PostgreSQL's integer failed every batch, and `run`
    retried for ever without publishing anything; a negative backoff burnt every attempt of a
    failing event in one batch; a fractional batch size failed every batch."""
    with pytest.raises(ValueError, match=next(iter(options))):
        Publisher(pool, _never_sent, **options)


@pytest.mark.parametrize("idle", [0, -1.0, float("nan")])
async def test_a_publisher_that_would_poll_in_a_loop_is_refused(pool: Any, idle: float) -> None:
    """Found by probing: `run(idle_seconds=0)` asked the database for due events in a tight loop
    while there were none."""
    with pytest.raises(ValueError, match="idle_seconds"):
        await Publisher(pool, _never_sent).run(idle_seconds=idle, batches=1)


async def test_a_bounded_run_with_nothing_due_does_not_idle_after_its_last_batch(
    pool: Any,
) -> None:
    """Found by probing: `run(batches=1)` (`outbox publish --once`) with nothing due slept its
    `idle_seconds` after its one batch before returning."""
    await pool.execute("DELETE FROM idem_outbox")
    run = Publisher(pool, _never_sent).run(batches=1, idle_seconds=60)
    report = await asyncio.wait_for(run, 10)
    assert (report.sent, report.failed) == (0, 0)


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text")


@pytest.mark.parametrize(
    ("error", "stored"),
    [
        (RuntimeError("body: a\x00b"), "RuntimeError: body: a\\x00b"),
        (RuntimeError("body: \ud800"), "RuntimeError: body: \\ud800"),
        (RuntimeError("x" * 1000), "RuntimeError: " + "x" * 486),
        (_Unprintable(), "_Unprintable"),
    ],
)
async def test_a_send_error_postgresql_cannot_store_is_recorded_all_the_same(
    pool: Any, error: Exception, stored: str
) -> None:
    """Found by probing: a sender's error holding a NUL or an unpaired surrogate (a receiver's
    body quoted in it, say) could not be written to `last_error`: the failure went unrecorded,
    with no backoff, and the event was parked in the end as one "no publisher finished sending",
    the real error lost. An exception whose str() raised ended the batch."""

    async def failing(event: OutboxEvent) -> bool:
        raise error

    async with pool.acquire() as conn:
        await add(conn, "t", 1, event_id="e")
    report = await Publisher(pool, failing, base_backoff_seconds=60).publish_batch()
    assert (report.sent, report.failed) == (0, 1)
    row = await pool.fetchrow(
        "SELECT last_error, next_attempt_at > now() + interval '30 seconds' AS backed_off"
        " FROM idem_outbox"
    )
    assert row["last_error"] == stored
    assert row["backed_off"]


async def test_a_sender_raising_cancelled_error_of_its_own_is_a_failed_send(pool: Any) -> None:
    """Found by probing: a sender that raised CancelledError while the publisher was not being
    cancelled ended `run` (an application's publisher task stopped publishing), the event left
    reserved. It is a failed send now; cancelling the publisher itself still cancels it."""

    async def cancels(event: OutboxEvent) -> bool:
        raise asyncio.CancelledError

    async with pool.acquire() as conn:
        await add(conn, "t", 1, event_id="e")
    report = await asyncio.wait_for(Publisher(pool, cancels).run(batches=1, idle_seconds=1), 10)
    assert (report.sent, report.failed) == (0, 1)
    assert "CancelledError" in await pool.fetchval("SELECT last_error FROM idem_outbox")

    entered = asyncio.Event()

    async def hangs(event: OutboxEvent) -> bool:
        entered.set()
        await asyncio.Event().wait()
        return True

    await pool.execute("UPDATE idem_outbox SET next_attempt_at = now()")
    task = asyncio.ensure_future(Publisher(pool, hangs).run(batches=1, idle_seconds=1))
    await asyncio.wait_for(entered.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize(
    ("consumer", "event_id", "error"),
    [
        ("ledger", "e\x00", ValueError),
        ("ledger", "", ValueError),
        ("ledger", "e" * 1025, ValueError),
        ("ledger", "\ud800", ValueError),
        ("ledger", 5, TypeError),
        ("led\x00ger", "e", ValueError),
        (None, "e", TypeError),
    ],
)
async def test_an_event_id_the_database_would_refuse_is_refused_by_consume_once(
    pool: Any, consumer: Any, event_id: Any, error: type[Exception]
) -> None:
    """Found by probing: a NUL in an event id from a hostile webhook body reached the database,
    whose refusal aborted the consumer's transaction. It is refused before any statement, and
    the transaction goes on."""
    async with pool.acquire() as conn, conn.transaction():
        with pytest.raises(error):
            await consume_once(conn, consumer, event_id)
        assert await consume_once(conn, "ledger", "fine")  # the transaction is still usable
    assert await pool.fetchval("SELECT count(*) FROM idem_inbox") == 1


async def test_consume_once_outside_a_transaction_is_refused_and_notes_nothing(pool: Any) -> None:
    """On a connection in autocommit (or on the pool), the note committed at once: the
    consumer's own write then failed, and the redelivery found the event applied."""
    async with pool.acquire() as conn:
        with pytest.raises(TypeError, match="outside a transaction"):
            await consume_once(conn, "ledger", "autocommit")
    with pytest.raises(TypeError, match="not on a Pool"):
        await consume_once(pool, "ledger", "pooled")
    assert await pool.fetchval("SELECT count(*) FROM idem_inbox") == 0


class _Client:
    def __init__(self) -> None:
        self.posts: list[dict[str, Any]] = []

    async def post(self, url: str, **options: Any) -> Any:
        self.posts.append(options)
        return type("Answer", (), {"status_code": 201})()


@pytest.mark.parametrize("event_id", ["café", "with space", 'a"b', "k" * 256])
async def test_webhook_sender_says_which_event_ids_cannot_be_a_key_header(event_id: str) -> None:
    """Found by probing: an event id that cannot travel as the Idempotency-Key header as it is
    failed in the HTTP client (UnicodeEncodeError) or was refused by the receiver (400), attempt
    after attempt, with nothing saying why. The sender now says so, without sending."""
    client = _Client()
    send = webhook_sender(client, "http://127.0.0.1:1/events")
    event = OutboxEvent(event_id, None, "t", 1, 1)
    with pytest.raises(ValueError, match="Idempotency-Key header"):
        await send(event)
    assert client.posts == []
    assert await send(OutboxEvent("credit:42", None, "t", 1, 1))
    assert client.posts[0]["headers"] == {"Idempotency-Key": "credit:42"}


async def test_no_connection_is_held_while_a_receiver_takes_its_time(
    pool: Any, db_target: tuple[str, dict[str, Any]]
) -> None:
    """A batch held one pooled connection from its first reservation to its last mark, through
    every send: on an app's pool of one, nothing else could run while a receiver was slow. Each
    statement now takes a connection of its own and gives it back before the send."""
    async with pool.acquire() as conn:
        for n in range(3):
            await add(conn, "t", {"n": n})
    dsn, options = db_target
    async with asyncpg.create_pool(dsn, min_size=1, max_size=1, **options) as one:
        reads: list[int] = []

        async def reads_the_same_pool(event: OutboxEvent) -> bool:
            # (The app's own work during a send: it needs the pool's only connection.)
            async with one.acquire(timeout=3) as conn:
                reads.append(await conn.fetchval("SELECT 1"))
            return True

        report = await Publisher(one, reads_the_same_pool, send_timeout_seconds=5).publish_batch()
    assert (report.sent, report.failed, reads) == (3, 0, [1, 1, 1])


@pytest.mark.parametrize(
    "options",
    [
        {"batch_size": 0},
        {"batch_size": -1},
        {"batch_size": 1.5},
        {"max_batches": 0},
        {"max_batches": 2**31},
        {"max_batches": 2.0},
        {"older_than_seconds": float("nan")},
        {"older_than_seconds": float("inf")},
        {"older_than_seconds": -1.0},
    ],
)
async def test_purge_sent_refuses_what_cannot_work_before_any_statement(
    pool: Any, options: dict[str, Any]
) -> None:
    """Found by probing: a `batch_size` of 0 ran 10,000 empty DELETEs and returned 0, a negative
    age deleted nothing, and a negative batch, NaN or an infinity were statements the server
    refused (StatementRefused). Each is a ValueError naming the option; nothing is deleted."""
    await pool.execute(
        "INSERT INTO idem_outbox (event_id, topic, payload, sent_at)"
        " VALUES ('old', 't', '{}', now() - interval '30 days')"
    )
    with pytest.raises(ValueError, match=next(iter(options))):
        await purge_sent(pool, **options)
    assert await pool.fetchval("SELECT count(*) FROM idem_outbox") == 1

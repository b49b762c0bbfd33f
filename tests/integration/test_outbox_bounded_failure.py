"""A bounded publisher run (`Publisher.run(batches=N)`, `outbox publish --once`) whose last batch
the database fails partway: the server of this module's own (tests/restarts.py) is stopped while
an event is being sent. The failure is the caller's to see, at once: `run` raises it, with what
was done in the `report` it was given, and the command exits 1 saying so. Before, `run` logged
"outbox batch failed; retrying", waited out a backoff and returned an empty report, the same as
"nothing was due", and `--once` printed it and exited 0."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest

from idem_middleware import PostgresStore
from idem_middleware.errors import StoreError
from idem_middleware.outbox import OutboxEvent, Publisher, PublishReport, add
from tests.restarts import OwnServer

#: The most anything is waited for (a bound, not a timing): a run that backed off (60 s here)
#: before returning, as it did, runs into it.
BOUND = 15.0


async def _add_events(dsn: str, count: int) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        for i in range(count):
            await add(conn, "t", {"i": i}, event_id=f"e{i}")
    finally:
        await conn.close()


async def _rows(own_server: OwnServer, dsn: str) -> dict[str, tuple[int, bool]]:
    """Each event's attempts and whether it is marked sent, the server started again."""
    await asyncio.to_thread(own_server.start)
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT event_id, attempts, sent_at IS NOT NULL AS sent FROM idem_outbox"
        )
    finally:
        await conn.close()
    return {row["event_id"]: (row["attempts"], row["sent"]) for row in rows}


def _stopping_sender(own_server: OwnServer, sent: list[str], at: int) -> Any:
    """A sender that takes every event, and stops the server while the `at`th is sent."""

    async def sender(event: OutboxEvent) -> bool:
        sent.append(event.event_id)
        if len(sent) == at:
            await asyncio.to_thread(own_server.stop)  # returns once every session is ended
        return True

    return sender


async def test_a_bounded_run_raises_its_last_batchs_failure_at_once(
    own_server: OwnServer, own_dsn: str
) -> None:
    """The server stops while the second of three events is sent: the first was sent and
    marked, the second's mark fails. `run(batches=1)` raises the store's error without backing
    off (60 s here). It returned an empty report once that backoff was over."""
    await _add_events(own_dsn, 3)
    sent: list[str] = []
    async with PostgresStore(dsn=own_dsn, min_size=1, max_size=2, listen=False) as store:
        sender = _stopping_sender(own_server, sent, 2)
        publisher = Publisher(store, sender, batch_size=10, base_backoff_seconds=60)
        with pytest.raises(StoreError):
            await asyncio.wait_for(publisher.run(batches=1, idle_seconds=60), BOUND)
    assert sent == ["e0", "e1"]
    # The second event stays reserved (sent again once that lapses); the third was not tried.
    rows = await _rows(own_server, own_dsn)
    assert rows == {"e0": (1, True), "e1": (1, False), "e2": (0, False)}


async def test_the_report_given_to_a_failed_bounded_run_holds_what_it_did(
    own_server: OwnServer, own_dsn: str
) -> None:
    """Two batches of two: the first sends two events, the second one more before the server
    stops while the fourth is sent. The error is raised, and the report `run` was given counts
    the three sends marked, those of the batch that failed with them."""
    await _add_events(own_dsn, 4)
    sent: list[str] = []
    report = PublishReport()
    async with PostgresStore(dsn=own_dsn, min_size=1, max_size=2, listen=False) as store:
        sender = _stopping_sender(own_server, sent, 4)
        publisher = Publisher(store, sender, batch_size=2, base_backoff_seconds=60)
        run = publisher.run(batches=2, idle_seconds=60, report=report)
        with pytest.raises(StoreError):
            await asyncio.wait_for(run, BOUND)
    assert sent == ["e0", "e1", "e2", "e3"]
    assert report == PublishReport(sent=3, failed=0, parked=0)
    rows = await _rows(own_server, own_dsn)
    assert rows == {"e0": (1, True), "e1": (1, True), "e2": (1, True), "e3": (1, False)}


@pytest.fixture
def webhook(own_server: OwnServer) -> Iterator[tuple[str, list[str]]]:
    """A receiver that takes every event, and stops the server while the second is being sent:
    its URL, and the event ids it received."""
    received: list[str] = []

    class Receiver(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            received.append(body["event_id"])
            if len(received) == 2:
                own_server.stop()
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook", received
    finally:
        server.shutdown()
        server.server_close()


async def test_outbox_publish_once_exits_1_when_the_database_fails_its_batch(
    own_server: OwnServer, own_dsn: str, webhook: tuple[str, list[str]]
) -> None:
    """`--once` whose batch the server fails partway exits 1 at once (not after `--idle-seconds`,
    60 here): its JSON report says what it did and the error, and stderr ends with one line
    saying so. It printed `{"sent": 0, "failed": 0, "parked": 0}` and exited 0."""
    url, received = webhook
    await _add_events(own_dsn, 3)
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "IDEM_DATABASE_URL")}
    command = [sys.executable, "-m", "idem_middleware.cli", "--dsn", own_dsn, "outbox", "publish"]
    command += ["--url", url, "--once", "--send-timeout", "30", "--idle-seconds", "60"]
    result = await asyncio.to_thread(
        subprocess.run, command, capture_output=True, text=True, timeout=BOUND, env=env
    )
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert received == ["e0", "e1"]
    report = json.loads(result.stdout)
    assert report.pop("error")
    assert report == {"sent": 1, "failed": 0, "parked": 0}
    last = result.stderr.splitlines()[-1]
    assert last.startswith(
        "idem-middleware: outbox publish stopped after sending 1 events (failed 0, parked 0);"
        " run it again: "
    ), result.stderr
    assert "outbox batch failed" not in result.stderr
    assert await _rows(own_server, own_dsn) == {"e0": (1, True), "e1": (1, False), "e2": (0, False)}


@pytest.mark.parametrize("closed", ["the app's pool", "the store"])
async def test_an_unbounded_run_on_a_closed_store_or_pool_ends_at_once(
    closed: str, db_dsn: str
) -> None:
    """Found by probing: a publisher whose store, or the asyncpg pool it was given, was closed
    (an app's shutdown closing its pool before it stopped the publisher) retried every batch
    for ever, a warning each time. No batch can succeed: `run` raises StoreClosed at once."""
    from idem_middleware.errors import StoreClosed

    async def sender(event: OutboxEvent) -> bool:
        raise AssertionError("nothing is sent")

    if closed == "the store":
        store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False)
        await store.open()
        publisher = Publisher(store, sender)
        await store.close()
    else:
        pool = await asyncpg.create_pool(db_dsn, min_size=1, max_size=2)
        publisher = Publisher(pool, sender)
        await pool.close()
    with pytest.raises(StoreClosed, match="closed"):
        await asyncio.wait_for(publisher.run(idle_seconds=0.01), BOUND)

"""Three publisher processes, each with its own pool, drain one outbox while one of them is
SIGKILLed mid-send: every event is delivered, no two sends of an event overlap, and the killed
send is delivered again only once its reservation lapsed. Every wait is bounded."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from idem_middleware.outbox import add

#: A publisher process: each send is a row (its start, and its end once the send returns, by the
#: database's clock); with KILLME, its fifth send writes FLAG and hangs there, to be SIGKILLed.
PUBLISHER = textwrap.dedent(
    """
    import asyncio, os, pathlib, sys, asyncpg
    from idem_middleware.outbox import Publisher

    DSN, FLAG, KILLME = sys.argv[1], sys.argv[2], sys.argv[3] == "1"

    async def main():
        pool = await asyncpg.create_pool(DSN, min_size=1, max_size=2)
        sends = 0

        async def send(event):
            nonlocal sends
            sends += 1
            row = await pool.fetchval(
                "INSERT INTO test_sends (event_id, pid) VALUES ($1, $2) RETURNING id",
                event.event_id, os.getpid())
            if KILLME and sends == 5:
                pathlib.Path(FLAG).write_text(event.event_id)
                await asyncio.sleep(3600)
            await asyncio.sleep(0.002)
            await pool.execute(
                "UPDATE test_sends SET ended = clock_timestamp() WHERE id = $1", row)
            return True

        publisher = Publisher(
            pool, send, batch_size=5, send_timeout_seconds=5.0, reservation_margin_seconds=0.5)
        for _ in range(600):  # bounded: until nothing is left unsent
            await publisher.run(batches=1, idle_seconds=0.05)
            if not await pool.fetchval("SELECT count(*) FROM idem_outbox WHERE sent_at IS NULL"):
                break
            await asyncio.sleep(0.02)

    asyncio.run(main())
    """
)

EVENTS = 90


async def test_publisher_processes_deliver_every_event_one_send_at_a_time(
    db_dsn: str, pool: Any, tmp_path: Path
) -> None:
    await pool.execute(
        "DROP TABLE IF EXISTS test_sends; CREATE TABLE test_sends (id bigserial PRIMARY KEY,"
        " event_id text NOT NULL, pid int NOT NULL,"
        " started timestamptz NOT NULL DEFAULT clock_timestamp(), ended timestamptz)"
    )
    async with pool.acquire() as conn:
        for i in range(EVENTS):
            await add(conn, "t", {"i": i}, event_id=f"e{i:03d}")
    script = tmp_path / "publisher.py"
    script.write_text(PUBLISHER)
    flag = tmp_path / "killed-mid-send"
    procs = [
        subprocess.Popen(  # noqa: ASYNC220 - processes to SIGKILL and wait for, bounded
            [sys.executable, str(script), db_dsn, str(flag), "1" if i == 0 else "0"],
            start_new_session=True,
        )
        for i in range(3)
    ]
    try:
        for _ in range(1200):  # bounded
            if flag.exists():
                break
            await asyncio.sleep(0.05)
        assert flag.exists(), "the first publisher never reached its fifth send"
        os.killpg(procs[0].pid, signal.SIGKILL)
        for proc in procs[1:]:
            await asyncio.to_thread(proc.wait, 120)
        assert [proc.returncode for proc in procs[1:]] == [0, 0]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    killed = flag.read_text()
    assert await pool.fetchval("SELECT count(*) FROM idem_outbox WHERE sent_at IS NULL") == 0
    sends = await pool.fetch("SELECT * FROM test_sends ORDER BY event_id, started")
    by_event = {
        event_id: list(rows) for event_id, rows in itertools.groupby(sends, lambda r: r["event_id"])
    }
    assert len(by_event) == EVENTS  # every event delivered
    assert {e: len(r) for e, r in by_event.items() if len(r) > 1} == {killed: 2}
    first, again = by_event[killed]
    assert first["ended"] is None  # killed mid-send
    # Sent again by another process once the reservation (5.5 s from the reserving statement,
    # just before the first send's row: 5 s is well within it) lapsed, not before.
    assert again["pid"] != first["pid"]
    lapse = await pool.fetchval("SELECT $1::timestamptz + interval '5 s'", first["started"])
    assert again["started"] >= lapse
    assert again["ended"] is not None

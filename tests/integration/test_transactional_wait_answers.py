"""Pinned: what a transactional request is told after its first attempt failed
(transactional_wait.run_transactional): a claim that timed out waiting for another session's
uncommitted record answers a 202 whose Location carries this request's digest; a conflict at
COMMIT that outlasts the retries is a 409 with Retry-After; a handler's own conflict that outlasts
them raises the handler's error, not the middleware's wrapper."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, Policy, PostgresStore, get_context
from idem_middleware.status import status_route
from tests.apps import assert_problem, build_app, client, key

PATH = "/w"
CREDIT = "/accounts/a1/credits"
CREDIT_OP = "POST /accounts/{account_id}/credits"
OP = "POST /w"


def _app(store: PostgresStore, handler: Any, policy: Policy) -> Starlette:
    return Starlette(
        routes=[Route(PATH, handler, methods=["POST"]), status_route(store)],
        middleware=[Middleware(IdempotencyMiddleware, store=store, default_policy=policy)],
    )


def _plain_client(app: Starlette, *, raise_app_exceptions: bool = False) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
    return httpx.AsyncClient(transport=transport, base_url="http://test")


async def test_a_claim_that_times_out_on_an_uncommitted_record_gets_a_202_naming_its_request(
    pool: asyncpg.Pool[Any], db_dsn: str
) -> None:
    """A claim that waited out its time for another session's uncommitted record (ClaimTimeout)
    is answered as in flight: with `accept_while_in_flight`, a 202 whose Location carries this
    request's digest, so once the other record commits with another fingerprint the status
    resource says `422 key-reused` instead of reading the other's success as this request's."""
    policy = Policy(accept_while_in_flight=True, wait_seconds=0.2)
    other = await asyncpg.connect(db_dsn)
    try:
        async with PostgresStore(pool=pool, listen=False, fast_path=False) as store:
            app = build_app(store, default_policy=policy)
            tx = other.transaction()
            await tx.start()
            # (Another session's record of the key, written without its claim lock, uncommitted.)
            await other.execute(
                "INSERT INTO idem_requests (tenant, operation, idem_key, fingerprint, state, mode,"
                " retention, response_status, expires_at) VALUES ('tenant-a', $1, 'k',"
                " '\\x00', 'succeeded', 'transactional', '1 hour', 201,"
                " now() + interval '1 hour')",
                CREDIT_OP,
            )
            async with client(app) as c:
                accepted = await asyncio.wait_for(
                    c.post(CREDIT, json={"amount": 1}, headers=key("k")), 10
                )
                await tx.commit()
                status = await c.get(accepted.headers.get("location", "/none"))
    finally:
        await other.close()
    assert accepted.status_code == 202, accepted.text
    assert "request=" in accepted.headers["location"]
    assert app.state.probe.calls == 0
    assert_problem(status, 422, "key-reused")


async def test_a_conflict_at_commit_past_the_retries_is_a_409_with_retry_after(
    pg_store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    """A serialization failure at COMMIT (a deferred trigger's, every time) runs the attempt
    again up to `max_serialization_retries`; past them the client is told `409` with
    Retry-After (the policy's), and nothing is recorded."""
    await pool.execute(
        """
        DROP TABLE IF EXISTS test_commit_never;
        CREATE TABLE test_commit_never (id int);
        CREATE OR REPLACE FUNCTION test_commit_never_fail() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION 'could not serialize' USING ERRCODE = 'serialization_failure';
        END $$;
        CREATE CONSTRAINT TRIGGER test_commit_never_trigger AFTER INSERT ON test_commit_never
            DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION test_commit_never_fail();
        """
    )
    calls = {"n": 0}

    async def handler(request: Request) -> Response:
        calls["n"] += 1
        await get_context(request).connection.execute("INSERT INTO test_commit_never VALUES (1)")
        return JSONResponse({}, status_code=201)

    policy = Policy(allow_anonymous=True, max_serialization_retries=1, retry_after_seconds=7)
    try:
        async with _plain_client(_app(pg_store, handler, policy)) as c:
            r = await asyncio.wait_for(c.post(PATH, json={}, headers={"idempotency-key": "k"}), 10)
        records = await pool.fetchval("SELECT count(*) FROM idem_requests")
    finally:
        await pool.execute("DROP TABLE test_commit_never; DROP FUNCTION test_commit_never_fail()")
    assert_problem(r, 409, "request-in-flight")
    assert r.headers.get("retry-after") == "7"
    assert calls["n"] == 2  # the first attempt and one retry
    assert records == 0


async def test_a_handlers_own_conflict_past_the_retries_raises_the_handlers_error(
    pg_store: PostgresStore,
) -> None:
    """A handler whose own statements keep failing with a serialization failure runs
    1 + `max_serialization_retries` times, then its own error goes on to the server (and the
    error trackers) as it raised it: asyncpg's SerializationError, not the middleware's
    RetryableConflict."""
    calls = {"n": 0}

    async def handler(request: Request) -> Response:
        calls["n"] += 1
        await get_context(request).connection.execute(
            "DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = '40001'; END $$"
        )
        return JSONResponse({}, status_code=201)  # pragma: no cover

    policy = Policy(allow_anonymous=True, max_serialization_retries=1)
    async with _plain_client(_app(pg_store, handler, policy), raise_app_exceptions=True) as c:
        with pytest.raises(asyncpg.exceptions.SerializationError):
            await asyncio.wait_for(c.post(PATH, json={}, headers={"idempotency-key": "k"}), 10)
    assert calls["n"] == 2

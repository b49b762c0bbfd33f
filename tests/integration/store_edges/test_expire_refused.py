"""A lapsed lease a retry marks `unknown` (or takes over), refused by the server with an error
no retry clears (a constraint or trigger an operator added to the store's table): the retry gets
`500 server-misconfigured` as a problem document naming it, as a refused claim does. The
driver's error escaped the store: the app's bare 500 on every retry, nothing of the library's
in the log."""

from __future__ import annotations

import asyncpg
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import LeaseExpiry, Mode, Policy, PostgresStore, get_context
from tests.apps import client, key, one_route_app
from tests.integration.store_edges.lapsed import lapsed_record

_CHECK = "operator_no_unknown_nor_takeover"


async def pay(request: Request) -> Response:
    ctx = get_context(request)
    if ctx.mode is Mode.LEASE:
        await ctx.fenced_connection()
    return JSONResponse({}, status_code=201)


@pytest.mark.parametrize(
    ("mode", "expiry"),
    [
        (Mode.LEASE, LeaseExpiry.UNKNOWN),
        (Mode.LEASE, LeaseExpiry.TAKEOVER),
        # (a route turned transactional meets a lease-mode record whose lease lapsed)
        (Mode.TRANSACTIONAL, LeaseExpiry.UNKNOWN),
    ],
)
async def test_a_lapsed_lease_the_server_will_not_move_is_refused_in_words(
    db_dsn: str, caplog: pytest.LogCaptureFixture, mode: Mode, expiry: LeaseExpiry
) -> None:
    name = f"lapsed-refused-{mode.value}-{expiry.value}"
    admin = await asyncpg.connect(db_dsn)
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False)
    lease = Policy(mode=Mode.LEASE, on_lease_expiry=expiry)
    policy = lease if mode is Mode.LEASE else Policy()
    try:
        async with store:
            app = one_route_app("/pay", pay, store=store, default_policy=policy)
            async with client(app) as c:
                await lapsed_record(c, store, admin, name)
                await admin.execute(
                    f"ALTER TABLE idem_requests ADD CONSTRAINT {_CHECK} CHECK (state <> 'unknown'"
                    f" AND (idem_key <> '{name}' OR generation = epoch)) NOT VALID"
                )
                r = await c.post("/pay", json={}, headers=key(name))
        assert r.status_code == 500, r.text
        assert r.headers["content-type"] == "application/problem+json"
        assert r.json()["type"].endswith("server-misconfigured")
        assert _CHECK in caplog.text
        assert name not in caplog.text  # (the DETAIL, "Failing row contains (..., key, ...)")
    finally:
        await admin.execute(f"ALTER TABLE idem_requests DROP CONSTRAINT IF EXISTS {_CHECK}")
        await admin.close()

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
from idem_middleware.store.base import RecordKey
from tests.apps import client, key, one_route_app

_CHECK = "operator_no_unknown_nor_takeover"


async def pay(request: Request) -> Response:
    await get_context(request).fenced_connection()
    return JSONResponse({}, status_code=201)


@pytest.mark.parametrize("expiry", [LeaseExpiry.UNKNOWN, LeaseExpiry.TAKEOVER])
async def test_a_lapsed_lease_the_server_will_not_move_is_refused_in_words(
    db_dsn: str, caplog: pytest.LogCaptureFixture, expiry: LeaseExpiry
) -> None:
    name = f"lapsed-refused-{expiry.value}"
    admin = await asyncpg.connect(db_dsn)
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False)
    policy = Policy(mode=Mode.LEASE, on_lease_expiry=expiry)
    try:
        async with store:
            app = one_route_app("/pay", pay, store=store, default_policy=policy)
            async with client(app) as c:
                # (The same request's fingerprint: a key is not part of it.)
                assert (await c.post("/pay", json={}, headers=key(f"{name}-0"))).status_code == 201
                fingerprint = await admin.fetchval(
                    "SELECT fingerprint FROM idem_requests WHERE idem_key = $1", f"{name}-0"
                )
                await store.claim_lease(  # a pending record whose executor stopped
                    RecordKey("tenant-a", "POST /pay", name), fingerprint,
                    retention_seconds=60, lease_seconds=30,
                )  # fmt: skip
                await admin.execute(
                    "UPDATE idem_requests SET lease_expires_at = now() - interval '1 second'"
                    " WHERE idem_key = $1",
                    name,
                )
                await admin.execute(
                    f"ALTER TABLE idem_requests ADD CONSTRAINT {_CHECK} CHECK (state <> 'unknown'"
                    f" AND (idem_key <> '{name}' OR generation = epoch)) NOT VALID"
                )
                r = await c.post("/pay", json={}, headers=key(name))
        assert r.status_code == 500, r.text
        assert r.headers["content-type"] == "application/problem+json"
        assert r.json()["type"].endswith("server-misconfigured")
        assert _CHECK in caplog.text
    finally:
        await admin.execute(f"ALTER TABLE idem_requests DROP CONSTRAINT IF EXISTS {_CHECK}")
        await admin.close()

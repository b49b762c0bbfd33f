"""A token that was used and has since expired is refused as used, not as expired, by the
PostgreSQL store as by the memory twin: `rows.token_problem` checks `unused` before `live`
(`tables._token_problem` checks `consumed` before `expires_at`). "Already used" tells the client
its request was made once; "expired" would read as though it never ran."""

from __future__ import annotations

from typing import Any

import pytest

from idem_middleware import MemoryStore, Mode, Policy, PostgresStore
from idem_middleware.tokens import TokenIssuer
from tests.apps import assert_problem, build_app, client

SECRET = b"s" * 32
OP = "POST /accounts/{account_id}/credits"
URL = "/accounts/t1/credits"


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_used_token_past_its_expiry_is_refused_as_used(
    pg_store: PostgresStore, pool: Any, mode: Mode
) -> None:
    issuer = TokenIssuer(pg_store, secret=SECRET, ttl_seconds=600)
    token = (await issuer.issue("tenant-a", OP, intent_id="order-1")).token
    app = build_app(pg_store, policies={OP: Policy(require_token=True, mode=mode, wait_seconds=5)})
    headers = {"idempotency-key": token}
    async with client(app) as c:
        assert (await c.post(URL, json={"amount": 5}, headers=headers)).status_code == 201
        # The record's retention and the token's life are both over; purge keeps the token.
        await pool.execute("UPDATE idem_requests SET expires_at = now() - interval '1 second'")
        await pool.execute("UPDATE idem_tokens SET expires_at = now() - interval '1 second'")
        await pg_store.purge()
        assert await pool.fetchval("SELECT count(*) FROM idem_requests") == 0
        again = await c.post(URL, json={"amount": 5}, headers=headers)
    detail = assert_problem(again, 400, "token-invalid")["detail"]
    assert "already used" in detail, detail
    assert "expired" not in detail, detail
    assert app.state.probe.calls == 1


async def test_the_memory_twin_refuses_a_used_expired_token_as_used_too() -> None:
    now = [1000.0]
    store = MemoryStore(clock=lambda: now[0])
    issuer = TokenIssuer(store, secret=SECRET, ttl_seconds=60)
    token = (await issuer.issue("tenant-a", OP, intent_id="order-1")).token
    app = build_app(store, policies={OP: Policy(require_token=True)})
    headers = {"idempotency-key": token}
    async with client(app) as c:
        assert (await c.post(URL, json={"amount": 5}, headers=headers)).status_code == 201
        now[0] += 2 * 86400  # past the token's life and the record's retention
        await store.purge()
        again = await c.post(URL, json={"amount": 5}, headers=headers)
    detail = assert_problem(again, 400, "token-invalid")["detail"]
    assert "already used" in detail, detail
    assert "expired" not in detail, detail
    assert app.state.probe.calls == 1

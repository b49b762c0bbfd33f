"""A one-time token is given back only by the release of the record life that consumed it.

Found by an earlier hunt: with `require_token` turned off for a while, a client sent its consumed
token as a plain `Idempotency-Key` on a key whose record's retention was over; that plain claim
was released (a 4xx), and the release marked the token unused (queries.sql `release` matched the
token by the key's hash alone). With `require_token` on again, the token ran a second time."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from idem_middleware import MemoryStore, Mode, Policy, PostgresStore
from idem_middleware.context import token_hash
from idem_middleware.store.base import (
    Claimed,
    RecordKey,
    Settlement,
    State,
    StoredResponse,
    TokenRefused,
)
from idem_middleware.tokens import TokenIssuer
from tests.apps import build_app, client

OP = "POST /accounts/{account_id}/credits"
URL = "/accounts/t1/credits"
FINGERPRINT = b"\x01" * 32
DONE = StoredResponse(201, [], b"{}")


async def _token(store: Any, intent: str) -> tuple[str, RecordKey]:
    issuer = TokenIssuer(store, secret=b"s" * 32)
    token = (await issuer.issue("tenant-a", OP, intent_id=intent, ttl_seconds=300)).token
    return token, RecordKey("tenant-a", OP, token)


async def _claim(store: Any, key: RecordKey, token: str | None, **times: float) -> Any:
    return await store.claim_lease(
        key,
        FINGERPRINT,
        retention_seconds=times.get("retention", 60),
        lease_seconds=times.get("lease", 30),
        token_hash=None if token is None else token_hash(token),
    )


async def test_releasing_a_plain_claim_of_a_consumed_token_keeps_it_used(
    store: MemoryStore | PostgresStore,
) -> None:
    token, key = await _token(store, "pay-1")
    first = await _claim(store, key, token, retention=0.05)
    assert isinstance(first, Claimed), first
    assert await store.settle(
        key, first.generation, State.PENDING, Settlement(State.SUCCEEDED, DONE)
    )
    await asyncio.sleep(0.2)  # the token's record's retention is over
    # `require_token` off: the token sent as a plain key claims the expired record afresh ...
    plain = await _claim(store, key, None)
    assert isinstance(plain, Claimed), plain
    assert await store.release(key, plain.generation)  # ... and is released (a 4xx)
    # `require_token` on again: the token was consumed by the first life, and stays used.
    again = await _claim(store, key, token)
    assert isinstance(again, TokenRefused), again  # (it was Claimed: the token ran twice)
    assert "already used" in again.reason


async def test_the_life_that_consumed_a_token_still_gives_it_back_after_a_takeover(
    store: MemoryStore | PostgresStore,
) -> None:
    """The narrowing keeps what was meant: the consuming life's release (here by the executor
    that took its lapsed lease over, the same life) gives the token back."""
    token, key = await _token(store, "pay-2")
    first = await _claim(store, key, token, lease=0.05)
    assert isinstance(first, Claimed), first
    await asyncio.sleep(0.2)  # its executor died: the lease lapsed
    taken = await store.takeover(key, first.generation, State.PENDING, 30)
    assert taken is not None
    assert await store.release(key, taken)  # the new executor's 4xx: nothing happened
    again = await _claim(store, key, token)
    assert isinstance(again, Claimed), again


@pytest.mark.parametrize("mode", [Mode.LEASE, Mode.TRANSACTIONAL])
async def test_a_token_runs_once_across_a_require_token_toggle(
    pg_store: PostgresStore, pool: Any, mode: Mode
) -> None:
    """Through the middleware, on PostgreSQL. (Transactional mode releases by rolling its claim
    back, which never touched the token: it held before the fix too; lease mode did not.)"""
    token, _ = await _token(pg_store, f"pay-{mode.value}")
    short: dict[str, Any] = {"mode": mode, "wait_seconds": 5, "retention_seconds": 0.2}
    tokens_on = build_app(pg_store, policies={OP: Policy(require_token=True, **short)})
    tokens_off = build_app(pg_store, policies={OP: Policy(require_token=False, **short)})
    headers = {"idempotency-key": token}
    async with client(tokens_on) as c:
        first = await c.post(URL, json={"amount": 5}, headers=headers)
    assert first.status_code == 201, first.text
    await asyncio.sleep(0.4)  # its retention is over
    async with client(tokens_off) as c:
        refused = await c.post(URL + "?respond=422", json={"amount": 5}, headers=headers)
    assert refused.status_code == 422, refused.text  # released: nothing happened
    async with client(tokens_on) as c:
        again = await c.post(URL, json={"amount": 5}, headers=headers)
    assert again.status_code == 400, again.text  # (201: the token ran a second time)
    assert again.json()["type"] == "urn:idem-middleware:problem:token-invalid"
    assert tokens_on.state.probe.calls == 1
    consumed = await pool.fetchval(
        "SELECT consumed_at IS NOT NULL FROM idem_tokens WHERE token_hash = $1",
        token_hash(token),
    )
    assert consumed is True

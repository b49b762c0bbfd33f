"""Two token behaviours no other test pins: the token route answers a JSON body whose
intent_id (or operation) is no string with 400 body-invalid, not a 500; and asking again for an
intent whose token a lease-mode request consumed, that request's lease since lapsed, is told at
once that the token was used (TokenConflict), not made to wait for a run that is gone and then
told 503 "still runs"."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from idem_middleware import MemoryStore, PostgresStore, tokens
from idem_middleware.context import token_hash
from idem_middleware.store.base import Claimed, RecordKey
from idem_middleware.tokens import TokenConflict, TokenIssuer
from tests.apps import BOUND, assert_problem
from tests.integration.test_token_hardening import SECRET, TOKENS, route_client, route_only_app
from tests.integration.test_tokens import OP


@pytest.mark.parametrize(
    "body",
    [
        {"operation": OP, "intent_id": 5},
        {"operation": OP, "intent_id": ["i"]},
        {"operation": OP, "intent_id": {"id": "i"}},
        {"operation": 5, "intent_id": "i"},
        {"operation": None},
    ],
    ids=["int intent", "list intent", "object intent", "int operation", "null operation"],
)
async def test_the_token_route_refuses_a_value_that_is_no_string(body: dict[str, Any]) -> None:
    async with route_client(route_only_app(TokenIssuer(MemoryStore(), secret=SECRET))) as c:
        assert_problem(await c.post(TOKENS, json=body), 400, "body-invalid")


async def test_a_token_used_by_a_lease_mode_request_whose_lease_lapsed_is_a_conflict_at_once(
    store: MemoryStore | PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (Were the lapsed run waited for, these pauses would end in StoreError "still runs".)
    monkeypatch.setattr(tokens, "_BUSY_PAUSES", (0.05,) * 4)
    issuer = TokenIssuer(store, secret=SECRET)
    token = (await issuer.issue("tenant-a", OP, intent_id="gone-1", ttl_seconds=0.3)).token
    claim = await store.claim_lease(
        RecordKey("tenant-a", OP, token),
        b"\x00" * 32,
        retention_seconds=60,
        lease_seconds=0.3,
        token_hash=token_hash(token),
    )
    assert isinstance(claim, Claimed), claim
    await asyncio.sleep(0.4)  # its executor died: the lease lapses, and the token expires
    record = await store.get(RecordKey("tenant-a", OP, token))
    assert record is not None
    assert record.lease_expired
    with pytest.raises(TokenConflict, match="already used"):
        await asyncio.wait_for(issuer.issue("tenant-a", OP, intent_id="gone-1"), BOUND)


async def test_issue_refuses_an_intent_id_holding_a_nul_on_either_store(
    store: MemoryStore | PostgresStore,
) -> None:
    """A ValueError before any statement, as for an unpaired surrogate: the in-memory store
    issued it (a token PostgreSQL could never hold), and PostgreSQL refused it only after a
    round trip, with the driver's error."""
    issuer = TokenIssuer(store, secret=SECRET)
    with pytest.raises(ValueError, match="intent_id must be"):
        await issuer.issue("tenant-a", OP, intent_id="secret\x00id")

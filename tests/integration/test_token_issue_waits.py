"""Asking for an intent's token while a request consuming its expired token still runs (a
handler longer than the token's time to live): the answer waits for that request's end, with
no connection held. Found by probing: PostgreSQL's renewal (the upsert) waited inside the
database for the claim's row lock, each asker's pooled connection held for the rest of the
handler, so a client asking again and again could take the whole pool."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from idem_middleware import MemoryStore, PostgresStore, tokens
from idem_middleware.context import token_hash
from idem_middleware.errors import StoreError
from idem_middleware.store.base import Claimed, RecordKey, State, StoredResponse
from idem_middleware.tokens import TokenConflict, TokenIssuer
from tests.apps import BOUND
from tests.apps.concurrency import blocked_by

OP = "POST /t"
FINGERPRINT = b"\x00" * 32
DONE = StoredResponse(201, [], b"{}")
ASKERS = 6


async def _claimed_past_expiry(store: Any, issuer: TokenIssuer, intent: str) -> Any:
    """A transaction (returned, entered) whose claim consumes the intent's token, which has
    expired since."""
    token = (await issuer.issue("tenant-a", OP, intent_id=intent, ttl_seconds=0.3)).token
    tx = store.transaction(acquire_timeout=5)
    session = await tx.__aenter__()
    claim = await session.claim(
        RecordKey("tenant-a", OP, token),
        FINGERPRINT,
        retention_seconds=60,
        wait_seconds=1,
        token_hash=token_hash(token),
    )
    assert isinstance(claim, Claimed), claim
    await asyncio.sleep(0.4)  # the handler runs past the token's expiry
    return tx, session, token


async def _fewest_checked_out(pool: Any, seconds: float = 0.3) -> int:
    """The fewest pooled connections checked out at any sample over `seconds`. An asker that
    held a connection while it waited would be seen at every sample; one merely polling (each
    look takes a connection for a statement, then gives it back) is not seen at all of them.
    (A single snapshot caught all six askers' looks at once, in a loaded CI run: 6 > 2.)"""
    fewest = pool.get_size()
    for _ in range(int(seconds / 0.01)):
        fewest = min(fewest, pool.get_size() - pool.get_idle_size())
        await asyncio.sleep(0.01)
    return fewest


@pytest.mark.parametrize("commits", [True, False], ids=["used", "rolled-back"])
async def test_askers_wait_for_the_consuming_request_holding_no_connection(
    pool: Any, commits: bool
) -> None:
    store = PostgresStore(pool=pool, listen=False)
    issuer = TokenIssuer(store, secret=b"s" * 32)
    tx, session, token = await _claimed_past_expiry(store, issuer, "pay-1")
    asking = [
        asyncio.create_task(issuer.issue("tenant-a", OP, intent_id="pay-1")) for _ in range(ASKERS)
    ]
    try:
        await asyncio.sleep(0.3)
        assert not any(task.done() for task in asking)
        # None waits inside the database for the claim's row (counted by who blocks them: a
        # momentary lock wait elsewhere on the server is not an asker's).
        assert await blocked_by(pool, session.connection) == 0
        assert await _fewest_checked_out(pool) <= 1  # the claim's
        if commits:
            await session.finish(State.SUCCEEDED, DONE)
    finally:
        await tx.__aexit__(None, None, None)
    answers = await asyncio.wait_for(asyncio.gather(*asking, return_exceptions=True), BOUND)
    for answer in answers:
        if commits:
            assert isinstance(answer, TokenConflict), answer
        else:  # the token was never used: renewed, the same token
            assert not isinstance(answer, BaseException), answer
            assert answer.token == token


async def test_an_asker_gives_up_with_a_store_error_on_either_store(
    store: MemoryStore | PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bounded: past its waits, the token route's 503 (ask again)."""
    monkeypatch.setattr(tokens, "_BUSY_PAUSES", (0.05,) * 4)
    issuer = TokenIssuer(store, secret=b"s" * 32)
    tx, _, _ = await _claimed_past_expiry(store, issuer, "pay-2")
    try:
        with pytest.raises(StoreError, match="still runs"):
            await asyncio.wait_for(issuer.issue("tenant-a", OP, intent_id="pay-2"), BOUND)
    finally:
        await tx.__aexit__(None, None, None)


async def test_a_lease_mode_request_still_running_on_an_expired_token_is_waited_for(
    store: MemoryStore | PostgresStore,
) -> None:
    """Found by probing: a lease-mode claim commits its token used at once, so nothing is
    locked and the store never says `busy`: asking for the intent while that request still ran
    past the token's expiry answered at once `409 token-conflict`, "not issued again", and the
    request's 422 then gave the token back. Now the asker waits for its end, as for a
    transactional one."""
    issuer = TokenIssuer(store, secret=b"s" * 32)
    token = (await issuer.issue("tenant-a", OP, intent_id="pay-3", ttl_seconds=0.3)).token
    key = RecordKey("tenant-a", OP, token)
    claim = await store.claim_lease(
        key, FINGERPRINT, retention_seconds=60, lease_seconds=30, token_hash=token_hash(token)
    )
    assert isinstance(claim, Claimed), claim
    await asyncio.sleep(0.4)  # the handler runs past the token's expiry
    asking = asyncio.create_task(issuer.issue("tenant-a", OP, intent_id="pay-3"))
    await asyncio.sleep(0.3)
    assert not asking.done()  # (it answered 409 here)
    assert await store.release(key, claim.generation)  # the request's 422: the token given back
    answer = await asyncio.wait_for(asking, BOUND)
    assert answer.token == token

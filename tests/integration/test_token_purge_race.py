"""A token claim racing the purge of its token: the claim's transaction began while the token
was live, and the token expired before the claim's statement ran; a purge deleting it holds its
row. The claim waits for the purge, then finds the token gone and refuses it. (It judged the
token by its snapshot, claimed it, and lost its consumed mark with the row: the intent was
issued the same token again, and once the record's retention passed the token ran again.)"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from idem_middleware import PostgresStore
from idem_middleware.context import token_hash
from idem_middleware.sql import queries
from idem_middleware.store.base import Claimed, RecordKey, State, StoredResponse, TokenRefused
from idem_middleware.tokens import TokenConflict, TokenIssuer
from tests.apps import BOUND

OP = "POST /t"
FINGERPRINT = b"\x00" * 32
DONE = StoredResponse(201, [], b"{}")


async def _until_waiting(pool: Any) -> None:
    """Until a session waits for a row lock (the claim, for the purge's)."""
    for _ in range(int(BOUND / 0.01)):
        waiting = await pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        )
        if waiting:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the claim never waited for the purge")


@pytest.mark.parametrize("expired_record", [False, True], ids=["new-record", "expired-record"])
async def test_a_token_purged_while_its_claim_began_is_refused_not_run(
    pg_store: PostgresStore, pool: Any, expired_record: bool
) -> None:
    issuer = TokenIssuer(pg_store, secret=b"s" * 32)
    token = (await issuer.issue("tenant-a", OP, intent_id="pay-42", ttl_seconds=0.6)).token
    key = RecordKey("tenant-a", OP, token)
    if expired_record:
        # A record under the key, from before the route took only tokens, its retention over.
        async with pg_store.transaction(acquire_timeout=5) as tx:
            assert isinstance(
                await tx.claim(key, b"f", retention_seconds=0.05, wait_seconds=1), Claimed
            )
            await tx.finish(State.SUCCEEDED, DONE)
        await pool.execute("UPDATE idem_tokens SET intent_id = NULL")  # (purged when expired)
        await asyncio.sleep(0.1)  # the record's retention is over
    async with pg_store.transaction(acquire_timeout=5) as tx:
        await tx.begin()  # while the token is live: the claim's now()
        await asyncio.sleep(0.7)  # the token expires
        async with pool.acquire() as sweeper:
            purging = sweeper.transaction()
            await purging.start()
            assert await sweeper.execute(queries()["purge_tokens"], 100, None) == "DELETE 1"
            claiming = asyncio.create_task(
                tx.claim(
                    key,
                    FINGERPRINT,
                    retention_seconds=60,
                    wait_seconds=5,
                    token_hash=token_hash(token),
                )
            )
            await _until_waiting(pool)
            await purging.commit()
        claim = await asyncio.wait_for(claiming, BOUND)
        assert isinstance(claim, TokenRefused), claim
    record = await pg_store.get(key)
    if expired_record:
        assert record is not None
        assert record.expired  # left as it was: not reclaimed
    else:
        assert record is None
    if not expired_record:
        # Never claimed, the token was never used: its intent may be issued a token again.
        again = await issuer.issue("tenant-a", OP, intent_id="pay-42", ttl_seconds=60)
        assert again.token == token


async def test_a_consumed_tokens_intent_is_not_issued_again(
    pg_store: PostgresStore, pool: Any
) -> None:
    """The tombstone a claim leaves, which the race above erased: once the token expired and
    the purge ran, its intent is never issued a token again (a guard of the test's premise)."""
    issuer = TokenIssuer(pg_store, secret=b"s" * 32)
    token = (await issuer.issue("tenant-a", OP, intent_id="pay-43", ttl_seconds=0.3)).token
    key = RecordKey("tenant-a", OP, token)
    async with pg_store.transaction(acquire_timeout=5) as tx:
        claim = await tx.claim(
            key, FINGERPRINT, retention_seconds=60, wait_seconds=5, token_hash=token_hash(token)
        )
        assert isinstance(claim, Claimed)
        await tx.finish(State.SUCCEEDED, DONE)
    await asyncio.sleep(0.4)
    await pool.execute(queries()["purge_tokens"], 100, None)
    assert await pool.fetchval("SELECT count(*) FROM idem_tokens") == 1  # the tombstone
    with pytest.raises(TokenConflict):
        await issuer.issue("tenant-a", OP, intent_id="pay-43", ttl_seconds=60)


async def test_a_token_a_claim_is_consuming_outlives_a_purge_on_either_store(store: Any) -> None:
    """The claim's transaction holds its token (PostgreSQL: the row lock, which the purge's
    SKIP LOCKED passes by). A purge while the handler runs past the token's expiry leaves it,
    and the intent asked for again once the claim commits is refused, on the in-memory store
    too (it purged the token, lost the consumed mark, and issued the token again to run twice)."""
    issuer = TokenIssuer(store, secret=b"s" * 32)
    token = (await issuer.issue("tenant-a", OP, intent_id="pay-7", ttl_seconds=0.3)).token
    key = RecordKey("tenant-a", OP, token)
    async with store.transaction(acquire_timeout=5) as tx:
        claim = await tx.claim(
            key, FINGERPRINT, retention_seconds=60, wait_seconds=1, token_hash=token_hash(token)
        )
        assert isinstance(claim, Claimed), claim
        await asyncio.sleep(0.4)  # the handler runs past the token's expiry
        await store.purge()
        asking = asyncio.create_task(issuer.issue("tenant-a", OP, intent_id="pay-7"))
        await asyncio.sleep(0.2)
        assert not asking.done()  # an expired token's renewal waits for the claim's end
        await tx.finish(State.SUCCEEDED, DONE)
    with pytest.raises(TokenConflict, match="already used"):
        await asyncio.wait_for(asking, BOUND)
    await store.purge()  # the used token of an intent stays, as a tombstone
    with pytest.raises(TokenConflict, match="already used"):
        await issuer.issue("tenant-a", OP, intent_id="pay-7")

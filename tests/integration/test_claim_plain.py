"""`claim_plain` is `claim` without a token's statements (it saves the server their set-up on
every claim of an ordinary key): for every state a key can be in, and for a key whose claim lock
another transaction holds, the two answer alike. A change made to one and not the other fails
here, whichever of the shared parts it touched."""

from __future__ import annotations

from typing import Any

import pytest

from idem_middleware.store.postgres import _Q

KEY = ("tenant-a", "POST /pay", "k-1")
FINGERPRINT = b"\x01" * 32
LOCK = 4242
#: What both answer (`claim` adds the token's status); the new record's generation is a new
#: number each time, so only whether one came back is compared.
SHARED = (
    "claimed", "fingerprint", "state", "response_status", "response_headers", "response_body",
    "body_omitted", "expired", "lease_expired", "retry_allowed",
)  # fmt: skip

#: The record under KEY before the claims, made from a pending lease-mode claim of it.
STATES = {
    "none": None,
    "pending, leased": "",
    "pending, lease lapsed": "lease_expires_at = now() - interval '1 second'",
    "pending, released for a retry": "lease_expires_at = NULL",
    "unknown": "state = 'unknown', lease_expires_at = NULL",
    "succeeded": (
        "state = 'succeeded', lease_expires_at = NULL, expires_at = now() + interval '1 day',"
        " response_status = 201, response_headers = '\\x00'::bytea, response_body = 'ok'"
    ),
    "succeeded, expired": (
        "state = 'succeeded', lease_expires_at = NULL, expires_at = now() - interval '1 second',"
        " response_status = 201, response_headers = '\\x00'::bytea, response_body = 'ok'"
    ),
    "failed for good, body omitted": (
        "state = 'failed_final', lease_expires_at = NULL, expires_at = now() + interval '1 day',"
        " response_status = 400, response_headers = '\\x00'::bytea, body_omitted = 'too large'"
    ),
}


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize(
    ("mode", "lease", "lock"),
    [("lease", 30.0, LOCK), ("transactional", None, None)],
    ids=["lease", "transactional"],
)
async def test_claim_plain_answers_as_claim_does(
    pool: Any, state: str, mode: str, lease: float | None, lock: int | None
) -> None:
    async with pool.acquire() as conn:
        setup = STATES[state]
        if setup is not None:
            await conn.fetch(_Q["claim_plain"], *KEY, FINGERPRINT, "lease", 86400.0, 30.0, None)
            if setup:
                await conn.execute(
                    f"UPDATE idem_requests SET {setup}"
                    " WHERE tenant = $1 AND operation = $2 AND idem_key = $3",
                    *KEY,
                )
        before = await conn.fetch("SELECT * FROM idem_requests ORDER BY idem_key")
        claim, plain = await _rolled_back(conn, mode, lease, lock)
        assert claim == plain
        assert claim  # (every state answers a row: claimed, the record, or busy)
        assert await conn.fetch("SELECT * FROM idem_requests ORDER BY idem_key") == before


async def _rolled_back(conn: Any, mode: str, lease: float | None, lock: int | None) -> list[Any]:
    args = (*KEY, FINGERPRINT, mode, 86400.0, lease)
    answers = []
    for name in ("claim", "claim_plain"):
        tx = conn.transaction()
        await tx.start()
        try:
            if name == "claim":
                rows = await conn.fetch(_Q["claim"], *args, None, lock)
            else:
                rows = await conn.fetch(_Q["claim_plain"], *args, lock)
        finally:
            await tx.rollback()
        answers.append([(tuple(row[c] for c in SHARED), row["generation"] is None) for row in rows])
    return answers


async def test_claim_plain_answers_busy_as_claim_does_while_the_lock_is_held(pool: Any) -> None:
    """No record, and the key's claim lock another transaction's (a transactional claim running
    its handler): both answer busy (`claimed` NULL) and insert nothing."""
    async with pool.acquire() as holder, pool.acquire() as conn:
        async with holder.transaction():
            assert await holder.fetchval("SELECT pg_try_advisory_xact_lock($1::bigint)", LOCK)
            claim, plain = await _rolled_back(conn, "lease", 30.0, LOCK)
        assert claim == plain == [((None,) * 7 + (False, False, False), True)]
        assert await conn.fetchval("SELECT count(*) FROM idem_requests") == 0

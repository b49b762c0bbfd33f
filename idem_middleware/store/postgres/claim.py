"""The ordinary claim: a parameterised `claim`, and what to do when it returns nothing."""

from __future__ import annotations

import logging
from typing import Any

from ...errors import ClaimBusy, ClaimRefused, ClaimTimeout, StoreError, TextRefused
from ..base import Claim, Claimed, Existing, Record, RecordKey, TokenRefused
from .convert import (
    _Q,
    LOCK_NOT_AVAILABLE,
    SERVER_ERROR,
    TRANSLATED,
    lock_waited,
    scrub,
    translate,
)
from .rows import notify_token, to_record, token_problem

logger = logging.getLogger("idem_middleware.store")

# How often a claim re-reads a record that vanished between the INSERT and the SELECT (a
# concurrent claim rolled back, or a purge ran). Each pass makes progress, so a few suffice.
_CLAIM_ATTEMPTS = 4
# A statement told not to wait still needs time to run (as the session's claim does).
_MIN_STATEMENT_TIMEOUT = 0.05


def _claimed(row: Any) -> Claimed:
    epoch = row["epoch"]
    return Claimed(row["generation"], row["generation"] if epoch is None else epoch)


async def claim(
    executor: Any,
    key: RecordKey,
    args: tuple[Any, ...],
    token_hash: bytes | None,
    timeout: float | None,  # noqa: ASYNC109 - asyncpg's own per-statement timeout
    lock: int | None = None,
) -> Claim:
    """`_claim`; a statement the server refuses (a constraint, a trigger) without its DETAIL,
    which quotes the row (see convert.scrub)."""
    try:
        return await _claim(executor, key, args, token_hash, timeout, lock)
    except SERVER_ERROR as exc:
        scrub(exc)
        raise


def claim_refused(exc: BaseException) -> StoreError:
    """A server error the claim's callers have no answer of their own for (a privilege revoked
    since the store opened, a row-level security policy, a trigger; a text the client encoding
    cannot carry: TextRefused): no retry clears it. (It escaped as it was: the server's bare
    500, its DETAIL, or the value, in the log.)"""
    if isinstance(refused := translate(exc), TextRefused):
        return refused
    return ClaimRefused(f"{type(exc).__name__}: {exc}")


async def _claim(
    executor: Any,
    key: RecordKey,
    args: tuple[Any, ...],
    token_hash: bytes | None,
    timeout: float | None,  # noqa: ASYNC109 - asyncpg's own per-statement timeout
    lock: int | None,
) -> Claim:
    """Claim, or return the record holding the key, or why the token was refused (see
    queries.sql `claim`).

    `executor` is the claim's connection (transactional mode) or a connection of the pool's
    (lease mode: each statement commits on its own). With `token_hash`, only a live issued token
    may be claimed. With `lock` (lease mode), a key whose claim lock another transaction holds
    is ClaimBusy, as a row another transaction holds is; nothing here waits for either.
    """
    nowhere = 0  # passes whose write (the INSERT, an expired record's UPDATE) changed nothing
    for _ in range(_CLAIM_ATTEMPTS):
        if token_hash is None:  # (most keys: the claim without the token's statements)
            rows = await executor.fetch(_Q["claim_plain"], *args, lock, timeout=timeout)
        else:
            rows = await executor.fetch(_Q["claim"], *args, token_hash, lock, timeout=timeout)
        row = rows[0] if rows else None
        if row is not None:
            claimed = row["claimed"]
            if claimed:
                return _claimed(row)
            if claimed is None:
                raise ClaimBusy("a transaction is claiming this key")
        if row is None or row["state"] is None:
            if row is not None:
                # A token claim found no record: the token's status came with the claim.
                reason = token_problem(row if row["token_found"] else None)
                if reason:
                    return TokenRefused(reason)
            # The conflicting claim committed after our snapshot: read it afresh.
            row = await executor.fetchrow(_Q["get"], *args[:3], timeout=timeout)
            if row is None:
                # Gone again (released, or purged): claim again (a token claim finds out then
                # whether the token itself was refused).
                nowhere += 1
                continue
        record = to_record(key, row)
        if record.retry_allowed and args[4] == "transactional":
            # A lease-mode record released for a retry, its route transactional now: this
            # request's is taken over by this transaction (rolled back, it is released again).
            # Another transaction taking it over holds its row: the key is busy, for any request.
            try:
                reclaimed = await executor.fetchrow(
                    _Q["reclaim_released"], *args[:4], record.generation, args[5], timeout=timeout
                )
            except LOCK_NOT_AVAILABLE as exc:
                raise ClaimBusy("another transaction is claiming this key") from exc
            if reclaimed is None:
                continue  # changed meanwhile: claim again, and find who holds it
            if reclaimed["same"]:
                return _claimed(reclaimed)
            return Existing(record)  # another request's (422 key-reused)
        if not record.expired:
            return Existing(record)
        if token_hash is not None:
            reason = await _token_refusal(executor, key, token_hash, args[3], timeout)
            if reason:
                return TokenRefused(reason)
        try:
            reclaimed = await executor.fetchrow(
                _Q["reclaim_expired"], *args, token_hash, timeout=timeout
            )
        except LOCK_NOT_AVAILABLE as exc:
            raise ClaimBusy("another transaction is claiming this key") from exc
        if reclaimed is not None:
            return _claimed(reclaimed)
        nowhere += 1  # (the expired record as it was: taken over by another, or skipped)
    if nowhere == _CLAIM_ATTEMPTS:
        # Every time: no claim raced this one. Its write (the INSERT, or an expired record's
        # UPDATE) landed nowhere: a BEFORE trigger that returns NULL, a rule, rows sent to
        # another table. It answered 409 "retry" for ever.
        raise ClaimRefused(
            "the claim's write (an INSERT, or an expired record's UPDATE) changed nothing, and "
            "no other claim took the key: a trigger or rule on idem_requests skipped or moved "
            "it (the store's tables take none that do)"
        )
    raise ClaimTimeout("the record kept changing under the claim")


async def _token_refusal(
    executor: Any,
    key: RecordKey,
    token_hash: bytes,
    fingerprint: bytes,
    timeout: float | None,  # noqa: ASYNC109 - asyncpg's own per-statement timeout
) -> str:
    status = await executor.fetchrow(
        _Q["token_status"], key.tenant, token_hash, key.operation, fingerprint, timeout=timeout
    )
    return token_problem(status)


async def expire_lapsed(
    executor: Any,
    record: Record,
    timeout: float,  # noqa: ASYNC109 - asyncpg's own per-statement timeout
) -> Existing:
    """A lapsed lease-mode record a transactional claim found (`base.lapsed`) becomes `unknown`,
    in a statement of its own (after the claim's transaction) that waits for no lock; the record
    as it is then."""
    key = record.key
    try:
        row = await executor.fetchrow(
            _Q["expire_lapsed"],
            key.tenant,
            key.operation,
            key.key,
            record.generation,
            notify_token(key),
            timeout=max(timeout, _MIN_STATEMENT_TIMEOUT),
        )
    except TRANSLATED as exc:
        raise translate(exc) from exc
    except LOCK_NOT_AVAILABLE as exc:  # (the role's lock_timeout, behind a migration's lock)
        raise lock_waited(exc) from exc
    except SERVER_ERROR as exc:  # (a constraint or trigger refusing `unknown`: as lease mode's)
        raise claim_refused(exc) from exc
    return Existing(record if row is None else to_record(key, row))


async def lock_key(conn: Any, key: RecordKey, lock: int, timeout: float) -> None:  # noqa: ASYNC109
    """The ordinary path's claim takes the key's advisory lock too (without waiting), so its
    INSERT never queues behind another transaction's uncommitted claim of the key. (A lock this
    transaction holds already is taken again: advisory locks nest.)"""
    found = await conn.fetchval(
        _Q["claim_key_count"], key.tenant, key.operation, key.key, lock, timeout=timeout
    )
    if found == 2:
        raise ClaimBusy("another transaction is claiming this key")


async def taken_by_another(driver: Any, key: RecordKey) -> bool:
    """After a unique violation as a transaction wrote `key`'s record (or committed), and its
    rollback: whether the key has a live record now, so a claim that took no advisory lock (the
    ordinary path, a token claim, or a lease-mode claim of the same operation) committed it
    first; if not, another unique constraint refused the transaction (a handler's deferred one,
    or one an operator added to the store's table), which no attempt run again can clear. An
    expired record, or one released for a retry, is the one this transaction had taken over
    (back as it was): no one else's. True when it cannot tell (the connection gone, say): the
    attempt runs again, as it would have."""
    if driver is None:
        return True
    try:
        row = await driver.fetchrow(_Q["get"], *key)
    except (*TRANSLATED, SERVER_ERROR):
        logger.debug("the key's record could not be read again", exc_info=True)
        return True
    if row is None:
        return False
    record = to_record(key, row)
    return not (record.expired or record.retry_allowed)

"""A payout's writes to the ledger: the hold taken before the bank is called, and the debit that
records the payout and releases it.

While a payout's outcome is unknown (the bank's answer was lost), its money may have left: its
amount stays held, out of the balance, so that no other payout can spend it too. The hold is a
short transaction of its own, committed before the bank call (the fenced transaction commits
only with an outcome, and rolls back with an unknown one), keyed by the payout's downstream key:
a payout run again (reconciled as not having happened) finds its own hold and keeps it. The
debit releases the hold in the fenced transaction, with the outcome. No transaction and no row
lock is held while the bank is called.
"""

from __future__ import annotations

import asyncio
import enum
from typing import Any

from idem_middleware import outbox

from .models import PayoutOut


class Hold(enum.Enum):
    HELD = "held"  # taken now, or by an earlier run of this payout
    SHORT = "short"  # not enough money: a final 402
    MISSING = "missing"  # no such account for this tenant: a 404


class _NotHeld(Exception):
    """Ends the hold's transaction, rolling its row back (`hold_funds`)."""

    def __init__(self, why: Hold) -> None:
        self.why = why


async def hold_funds(
    pool: Any, tenant: str, account_id: str, amount: int, hold_key: str, seconds: float
) -> Hold:
    """The hold's row first: a run of this payout that holds it already (or is taking it at this
    moment: the insert waits for that one's end) leaves the balance alone. Then the money.
    Within `seconds` in all (a connection, a row another transaction holds), or TimeoutError and
    nothing held: a wait without end kept the payout's key pending, its lease renewed."""
    try:
        async with asyncio.timeout(seconds), pool.acquire() as conn, conn.transaction():
            taken = await conn.fetchval(
                "INSERT INTO ex_holds (hold_key, tenant, account_id, amount) "
                "VALUES ($1, $2, $3, $4) ON CONFLICT (hold_key) DO NOTHING RETURNING true",
                hold_key,
                tenant,
                account_id,
                amount,
            )
            if not taken:
                return Hold.HELD  # by an earlier run of this payout
            balance = await conn.fetchval(
                "UPDATE ex_accounts SET balance = balance - $3 "
                "WHERE tenant = $1 AND account_id = $2 AND balance >= $3 RETURNING balance",
                tenant,
                account_id,
                amount,
            )
            if balance is None:
                known = await conn.fetchval(
                    "SELECT true FROM ex_accounts WHERE tenant = $1 AND account_id = $2",
                    tenant,
                    account_id,
                )
                raise _NotHeld(Hold.SHORT if known else Hold.MISSING)
            return Hold.HELD
    except _NotHeld as refused:
        return refused.why


async def debit(
    conn: Any,
    tenant: str,
    account_id: str,
    amount: int,
    transfer: dict[str, Any],
    hold_key: str,
) -> PayoutOut:
    """Record the payout the bank made, in the fenced transaction: its hold is released (the
    money left the balance when it was held); a payout without one (held before holds were
    kept) is debited now."""
    released = await conn.fetchval(
        "DELETE FROM ex_holds WHERE hold_key = $1 RETURNING true", hold_key
    )
    balance = await conn.fetchval(
        "UPDATE ex_accounts SET balance = balance - $3 WHERE tenant = $1 AND account_id = $2 "
        "RETURNING balance",
        tenant,
        account_id,
        0 if released else amount,
    )
    payout_id = await conn.fetchval(
        "INSERT INTO ex_payouts (tenant, account_id, amount, bank_transfer_id) "
        "VALUES ($1, $2, $3, $4) RETURNING payout_id::text",
        tenant,
        account_id,
        amount,
        transfer["transfer_id"],
    )
    payout = PayoutOut(
        payout_id=payout_id,
        account_id=account_id,
        amount=amount,
        balance=balance,
        bank_transfer_id=transfer["transfer_id"],
    )
    # The event commits with the debit, in the fenced transaction, or not at all. Both the
    # handler and the reconciler's Happened path debit through here: one event per payout.
    await outbox.add(
        conn, "payout.created", payout.model_dump(), event_id=f"payout:{payout_id}", tenant=tenant
    )
    return payout

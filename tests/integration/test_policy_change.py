"""A route whose policy changes under it (docs/operating.md, "Rolling upgrades and rollbacks"):
two apps on one store, as two versions of a deploy, or two middlewares in one process guarding
the same operation. `POST /payouts` (tests/apps/lease.py) makes a downstream effect (a
`test_downstream` row, deduplicated by the downstream key) on every execution; each case checks
what a retry reaching the other app gets, and that no key ran twice.
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from idem_middleware import LeaseExpiry, Mode, PostgresStore, RecordKey
from idem_middleware.store.base import Claimed
from tests.apps import (
    BOUND,
    LEASE_POLICY,
    PAYOUTS,
    Step,
    assert_problem,
    assert_replay_of,
    build_lease_app,
    client,
    count,
    wait_for_waiters,
)
from tests.integration.test_lease_mode import (
    bank,  # noqa: F401 (a fixture)
    finish,
    post,
    probe_of,
    row,
    spawn,
)

TRANSACTIONAL = LEASE_POLICY.replace(mode=Mode.TRANSACTIONAL)
# A policy change, and what a retry of a request the old policy recorded gets from the new one.
REPLAYED = "replayed"
REUSED = "key-reused"
CHANGES: list[tuple[dict[str, Any], str]] = [
    # What the fingerprint covers: a different fingerprint, never a second execution.
    ({"include_headers": ("x-api-version",)}, REUSED),  # every request's changes
    ({"include_fields": ("amount",)}, REUSED),  # the body has other members
    ({"exclude_fields": ("note",)}, REPLAYED),  # the body has no "note"
    # The rest do not change which request a key names.
    ({"require_token": True}, REPLAYED),
    ({"key_required": False}, REPLAYED),
    ({"allow_anonymous": True}, REPLAYED),  # an authenticated caller keeps its tenant
    ({"lease_seconds": 1.0, "on_lease_expiry": LeaseExpiry.TAKEOVER}, REPLAYED),
    ({"retention_seconds": 1.0, "wait_seconds": 0.0}, REPLAYED),
    ({"mode": Mode.TRANSACTIONAL}, REPLAYED),
]


@pytest.mark.parametrize(("change", "verdict"), CHANGES)
async def test_a_retry_across_a_policy_change_runs_nothing_twice(
    pg_store: PostgresStore,
    bank: asyncpg.Pool[Any],  # noqa: F811
    change: dict[str, Any],
    verdict: str,
) -> None:
    old = build_lease_app(pg_store, bank, LEASE_POLICY)
    new = build_lease_app(pg_store, bank, LEASE_POLICY.replace(**change))
    async with client(old) as c_old, client(new) as c_new:
        first = await post(c_old)
        assert first.status_code == 201, first.text
        retried = await post(c_new)
        if verdict == REPLAYED:
            assert_replay_of(retried, first)
        else:
            assert_problem(retried, 422, REUSED)
        if not change.get("require_token"):  # (a plain key is not a token: 400, nothing claimed)
            # The other way round: the new policy records, the old one answers the retry.
            fresh = await post(c_new, "k2")
            assert fresh.status_code == 201, fresh.text
            back = await post(c_old, "k2")
            if verdict == REPLAYED:
                assert_replay_of(back, fresh)
            else:
                assert_problem(back, 422, REUSED)
    assert probe_of(new).calls == (0 if change.get("require_token") else 1)
    assert probe_of(old).calls == 1
    assert (
        await bank.fetchval("SELECT count(*) FROM test_downstream")
        == probe_of(new).calls + probe_of(old).calls
    )


async def test_a_token_route_refuses_a_new_plain_key_but_replays_an_old_one(
    pg_store: PostgresStore,
    bank: asyncpg.Pool[Any],  # noqa: F811
) -> None:
    """`require_token` turned on: a key the old version recorded is still answered (its replay),
    a plain key it never saw is `400 token-invalid`, with nothing claimed."""
    old = build_lease_app(pg_store, bank, LEASE_POLICY)
    new = build_lease_app(pg_store, bank, LEASE_POLICY.replace(require_token=True))
    async with client(old) as c_old, client(new) as c_new:
        first = await post(c_old)
        assert_replay_of(await post(c_new), first)
        assert_problem(await post(c_new, "k2"), 400, "token-invalid")
    assert await row(bank, "k2") is None
    assert probe_of(new).calls == 0


@pytest.mark.parametrize(
    ("holder", "duplicate"), [(TRANSACTIONAL, LEASE_POLICY), (LEASE_POLICY, TRANSACTIONAL)]
)
async def test_two_middlewares_on_one_store_guard_one_operation_in_two_modes(
    pg_store: PostgresStore,
    bank: asyncpg.Pool[Any],  # noqa: F811
    holder: Any,
    duplicate: Any,
) -> None:
    """Two apps in one process, on one store object, guard `POST /payouts`, one in each mode. A
    duplicate reaching one while the other runs the key waits for it (holding no connection)
    and replays its outcome; the key runs once."""
    first_app = build_lease_app(pg_store, bank, holder)
    second_app = build_lease_app(pg_store, bank, duplicate.replace(wait_seconds=BOUND))
    gate = asyncio.Event()
    probe_of(first_app).steps = [Step(fence="before", gate=gate)]
    async with client(first_app) as c_first, client(second_app) as c_second:
        task_first = spawn(post(c_first))
        await asyncio.wait_for(probe_of(first_app).entered.wait(), BOUND)
        task_second = spawn(post(c_second))
        await wait_for_waiters(second_app)
        gate.set()
        first = await finish(task_first)
        assert first.status_code == 201, first.text
        assert_replay_of(await finish(task_second), first)
    assert probe_of(second_app).calls == 0
    assert await count(bank, "test_ledger") == 1


@pytest.mark.parametrize("expiry", list(LeaseExpiry))
async def test_a_lease_a_transactional_version_found_lapsed_stays_unknown_after_a_rollback(
    pg_store: PostgresStore,
    bank: asyncpg.Pool[Any],  # noqa: F811
    expiry: LeaseExpiry,
) -> None:
    """A lease-mode process died mid-request; the retry reached the transactional version,
    which marks the lapsed lease `unknown` whatever the old route's `on_lease_expiry` (it cannot
    know it, and its own handler cannot take an effect elsewhere over). Rolled back to lease
    mode, even with `TAKEOVER`, the record stays `unknown` (a reconciler or an operator settles
    it): `409 outcome-unknown`, never a second execution."""
    lease = build_lease_app(pg_store, bank, LEASE_POLICY.replace(on_lease_expiry=expiry))
    tx = build_lease_app(pg_store, bank, TRANSACTIONAL)
    async with client(lease) as c_lease, client(tx) as c_tx:
        # The fingerprint this request has: from a record the lease app writes for another key.
        assert (await post(c_lease, "probe")).status_code == 201
        fingerprint = await bank.fetchval(
            "SELECT fingerprint FROM idem_requests WHERE idem_key = 'probe'"
        )
        key = RecordKey("tenant-a", f"POST {PAYOUTS}", "k1")
        claim = await pg_store.claim_lease(key, fingerprint, retention_seconds=60, lease_seconds=60)
        assert isinstance(claim, Claimed)
        await bank.execute(
            "UPDATE idem_requests SET lease_expires_at = now() - interval '1 second' "
            "WHERE idem_key = 'k1'"
        )
        assert_problem(await post(c_tx), 409, "outcome-unknown")
        assert_problem(await post(c_lease), 409, "outcome-unknown")
        where = {"operation": f"POST {PAYOUTS}", "key": "k1"}
        status = (await c_lease.get("/idempotency/status", params=where)).json()
    assert (status["state"], status["retry"]) == ("unknown", False)
    assert "operator" in status["detail"]
    assert probe_of(lease).calls == 1  # the probe key's
    assert probe_of(tx).calls == 0

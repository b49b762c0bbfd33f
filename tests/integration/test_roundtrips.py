"""Round trips per request path, measured from asyncpg's query log (not estimated).

The round-trip table in docs/performance.md is printed by `python -m bench.roundtrips`, which
runs the same measurement; these tests pin the numbers so a change that adds a round trip fails
here.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from idem_middleware import Policy, PostgresStore
from idem_middleware.store import RecordKey, TokenRefused
from tests.apps import QueryLog, build_app, client, logged_pool, wait_for_waiters


class KindLog(QueryLog):
    def kinds(self) -> list[str]:
        """Each message to the server reduced to a short name: BEGIN, claim, handler, ...; a
        simple-query message carrying several statements is named `a+b`."""
        out = []
        for q in self.queries:
            if q.startswith("SELECT pg_advisory_unlock_all()"):
                out.append("reset")  # asyncpg's pool resets a connection on release
            else:
                out.append("+".join(_kind(p.strip()) for p in q.split("; ") if p.strip(" ;")))
        return out


# The record's one insert, inlined (the older schema's inlined claim starts the same way, with
# fewer columns).
_INSERT_FINAL_INLINED = (
    "INSERT INTO idem_requests (tenant, operation, idem_key, fingerprint, state, mode, "
    "generation, retention, expires_at,"
)


def _kind(q: str) -> str:
    if q.startswith("BEGIN"):
        return "BEGIN"
    if q.startswith(("COMMIT", "ROLLBACK")):
        return q.rstrip(";").split()[0]
    if q.startswith("WITH free AS"):
        return "claim"
    if q.startswith(("SELECT * FROM idem_claim_key", "EXECUTE idem_claim_key")):
        return "claim-key"
    if q.startswith(("EXECUTE idem_insert_final", _INSERT_FINAL_INLINED)):
        return "complete"
    if q.startswith("PREPARE"):
        return "prepare"
    if q.startswith("SELECT inner_key, outer_key FROM idem_lock_secret"):
        return "lock-secret"
    if q.startswith("SELECT nextval('idem_generation_seq')"):
        return "draw"
    if q.startswith("SELECT true AS found"):
        return "get"
    if q.startswith(
        ("UPDATE idem_requests SET state = $5", "WITH completed AS", "EXECUTE idem_complete")
    ):
        return "complete"
    if "test_ledger" in q or "test_accounts" in q:
        return "handler"
    return q[:40]


@pytest.fixture
async def logged(db_dsn: str) -> Any:
    log = KindLog()
    async with logged_pool(db_dsn, log) as pool:
        yield pool, log


async def _post(c: Any, key: str, amount: int = 5) -> Any:
    return await c.post(
        "/accounts/a1/credits", json={"amount": amount}, headers={"idempotency-key": key}
    )


async def test_fresh_claim_adds_two_statements_and_no_round_trip(logged: Any) -> None:
    pool, log = logged
    store = PostgresStore(pool=pool)
    await store.check_given_pool()  # (the startup's checks of a pool given: what open() runs)
    log.queries.clear()
    app = build_app(store)
    async with client(app) as c:
        first = await _post(c, "fresh-1")
        # The first claim draws a batch of generations inside its transaction (no commit of its
        # own), and prepares the fast statements on its connection in the message that claims
        # (5: the claim and the record's insert, the completion of a reclaimed expired record,
        # and lease mode's fence and settlement). No schema check: open() refuses an unmigrated
        # database. (The claim lock's secret was read by the checks of the pool given.)
        assert log.kinds()[:3] == ["BEGIN", "draw", "prepare+" * 5 + "claim-key"]
        log.queries.clear()
        r = await _post(c, "fresh-2")
    assert first.status_code == r.status_code == 201
    # The bare handler's transaction is BEGIN, its 2 statements, COMMIT: 4 round trips. We add
    # the claim and the completion as statements, but they travel with the BEGIN and the COMMIT.
    # The claim writes nothing; the completion is the record's one INSERT.
    assert log.kinds() == [
        "BEGIN+claim-key",
        "handler",
        "handler",
        "complete+COMMIT",
        "reset",
    ]


async def test_replay_is_one_statement_in_a_short_transaction(logged: Any) -> None:
    pool, log = logged
    app = build_app(PostgresStore(pool=pool))
    async with client(app) as c:
        await _post(c, "replayed")
        log.queries.clear()
        r = await _post(c, "replayed")
    assert r.headers["idempotent-replayed"] == "true"
    # The fast claim finds a record holding the key; one read answers.
    assert log.kinds() == ["BEGIN+claim-key", "get", "ROLLBACK", "reset"]


async def test_mismatch_costs_the_same_as_a_replay(logged: Any) -> None:
    pool, log = logged
    app = build_app(PostgresStore(pool=pool))
    async with client(app) as c:
        await _post(c, "reused")
        log.queries.clear()
        r = await _post(c, "reused", amount=6)
    assert r.status_code == 422
    assert log.kinds() == ["BEGIN+claim-key", "get", "ROLLBACK", "reset"]


@pytest.mark.parametrize("where", ["this process", "another process"])
async def test_in_flight_duplicate_waits_then_reads_the_committed_record(
    logged: Any, where: str
) -> None:
    pool, log = logged
    app = build_app(PostgresStore(pool=pool), default_policy=Policy(wait_seconds=5))
    # (Another process: another app, its own middleware, on the same database.)
    other = (
        app
        if where == "this process"
        else build_app(PostgresStore(pool=pool), default_policy=Policy(wait_seconds=5))
    )
    other.state.probe = probe = app.state.probe
    async with client(app) as c, client(other) as c2:
        # (Each store's checks, made at its first request, and its statements prepared.)
        for warm_up in (c, c2):
            await _post(warm_up, f"warm-up-{id(warm_up)}")
        probe.entered.clear()
        probe.gate = asyncio.Event()
        first = asyncio.ensure_future(_post(c, "inflight"))
        await asyncio.wait_for(probe.entered.wait(), 5)
        log.queries.clear()
        second = asyncio.ensure_future(_post(c2, "inflight"))
        await wait_for_waiters(other, 1)  # the duplicate found the key busy and waits
        probe.gate.set()
        r1, r2 = await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert (r1.status_code, r2.status_code) == (201, 201)
    assert r2.headers["idempotent-replayed"] == "true"
    # The waiter, once the original has committed, finds the record and reads it. A duplicate of
    # a request of its own process asks nothing before that; one of another process's claims,
    # finds the key busy and gives its connection back at once, as often as it polls.
    # (On its own connection, whose first fast claim also prepares: not a round trip more.)
    kinds = [k.removeprefix("prepare+" * 5) for k in log.kinds()]
    duplicate = [k for k in kinds if k not in ("handler", "complete+COMMIT", "reset")]
    assert duplicate[-3:] == ["BEGIN+claim-key", "get", "ROLLBACK"]
    busy = duplicate[:-3]
    if where == "this process":
        assert busy == []
    else:
        assert busy, "the duplicate found the key busy at least once"
        assert busy == ["BEGIN+claim-key", "ROLLBACK"] * (len(busy) // 2)


@pytest.mark.parametrize("mode", ["transactional", "lease"])
async def test_a_refused_token_is_refused_with_its_reason_by_the_claim_itself(
    logged: Any, mode: str
) -> None:
    """A token claim that inserts nothing and finds no record brings the token's status back in
    the same statement: the refusal carries its reason, with no statement after the claim to
    ask why (there used to be two: the record's read and the token's status)."""
    pool, log = logged
    store = await PostgresStore(pool=pool).open()  # reads the claim lock's secret
    log.queries.clear()
    key = RecordKey("tenant-a", "POST /payouts", "not-a-token")
    if mode == "lease":
        claim = await store.claim_lease(
            key, b"f", retention_seconds=10, lease_seconds=5, token_hash=b"\x01" * 32
        )
        expected = ["claim"]
    else:
        async with store.transaction(acquire_timeout=5) as tx:
            claim = await tx.claim(
                key, b"f", retention_seconds=10, wait_seconds=1, token_hash=b"\x01" * 32
            )
        # (A token claim takes the ordinary path: its own BEGIN, and the key's try-lock.)
        expected = ["BEGIN", "SELECT count(*) FROM idem_claim_key($1, ", "claim", "ROLLBACK"]
    assert isinstance(claim, TokenRefused)
    assert claim.reason == "This key is not a token issued to you for this operation."
    assert [k for k in log.kinds() if k != "reset"] == expected

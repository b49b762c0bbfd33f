"""`reconcile_unknown` (`idem-middleware reconcile`) takes the unknown records in rotation.

It asked the oldest unknown records first (by `updated_at`), and `limit` counts every
reconciler run. A verdict that leaves the record unknown (`StillUnknown`, a reconciler that
failed, a record held) touched nothing, so with `limit` or more records a downstream system
"cannot tell yet" about for weeks, every cron'd run asked those same records and never reached
the newer ones: records nobody retries were never reconciled.

Now each record asked and left unknown is stamped (migration 0012: the database's time and the
generation asked under) and listed after those not asked yet: never-asked records first, oldest
first, then the least recently asked. `updated_at` is left alone (the oldest-unresolved alert
reads it). A record that goes unknown again later (a new generation) is first in line again.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import asyncpg
import pytest

from idem_middleware import MemoryStore, PostgresStore, sql
from idem_middleware.errors import ConfigurationError
from idem_middleware.ops import reconcile_unknown
from idem_middleware.reconcile import Happened, ReconcileContext, Reconciliation, StillUnknown
from idem_middleware.store import Claimed
from idem_middleware.store.base import RecordKey, State, Store
from idem_middleware.store.migrations import migrate
from tests.conftest import _fresh_database
from tests.integration.test_cli import cli, insert
from tests.integration.test_migrations import _apply_up_to

OP = "POST /payouts"
Reconciler = Callable[[ReconcileContext], Awaitable[Reconciliation]]


def _key(name: str) -> RecordKey:
    return RecordKey("tenant-a", OP, name)


async def _unknown(store: Store, *names: str, expire_order: tuple[str, ...] = ()) -> None:
    """Lease-mode records of `names`, claimed in that order, whose leases lapse and are then
    marked `unknown` in `expire_order` (default: the same): their `updated_at` order."""
    generations = {}
    for name in names:
        claim = await store.claim_lease(
            _key(name), b"f" * 32, retention_seconds=60, lease_seconds=0.01
        )
        assert isinstance(claim, Claimed)
        generations[name] = claim.generation
    await asyncio.sleep(0.05)
    for name in expire_order or names:
        assert await store.expire_lease(_key(name), generations[name])
        await asyncio.sleep(0.002)  # (distinct updated_at, whatever the clock's resolution)


def _asking(asked: list[str], answer: Callable[[str], Reconciliation | None]) -> Reconciler:
    """A reconciler that records the keys it is asked about; `answer` None: it raises."""

    async def reconciler(ctx: ReconcileContext) -> Reconciliation:
        asked.append(ctx.key)
        verdict = answer(ctx.key)
        if verdict is None:
            raise RuntimeError("the downstream system is down")
        return verdict

    return reconciler


def _still_unknown(key: str) -> Reconciliation:
    return StillUnknown("cannot tell yet")


async def _runs(
    store: Store, answer: Callable[[str], Reconciliation | None], runs: int, limit: int
) -> list[list[str]]:
    """The keys each of `runs` batches asked about, in order (`answer`: see `_asking`)."""
    asked: list[str] = []
    done: list[list[str]] = []
    for _ in range(runs):
        await reconcile_unknown(store, {OP: _asking(asked, answer)}, limit=limit, seconds=5)
        done.append(asked.copy())
        asked.clear()
    return done


async def _updated(store: Store, *names: str) -> dict[str, tuple[State, Any]]:
    found = {}
    for name in names:
        summary = await store.describe(_key(name))
        assert summary is not None
        found[name] = (summary.state, summary.updated_at)
    return found


@pytest.mark.parametrize("answer", [_still_unknown, lambda key: None], ids=["still", "fails"])
async def test_a_second_run_asks_the_record_the_first_left_out(
    store: Store, answer: Callable[[str], Reconciliation | None]
) -> None:
    """The defect: with `limit` 2 and three records the reconciler cannot settle (it answers
    StillUnknown, or raises), every run asked `a` and `b` and never `c`."""
    await _unknown(store, "a", "b", "c")
    before = await _updated(store, "a", "b", "c")
    asked: list[str] = []
    reconciler = _asking(asked, answer)
    seen = []
    for _ in range(3):
        report = await reconcile_unknown(store, {OP: reconciler}, limit=2, seconds=5)
        assert report.examined == 2
        seen.append(asked.copy())
        asked.clear()
    assert seen == [["a", "b"], ["c", "a"], ["b", "c"]]
    # Nothing but the stamp moved: still unknown, `updated_at` (the alert's age) as it was.
    assert await _updated(store, "a", "b", "c") == before


async def test_never_asked_records_are_still_asked_oldest_first(store: Store) -> None:
    """Claimed c, a, b (so stored in that order), gone unknown a, b, c: asked a, b, c; and a
    record gone unknown after a run comes before those that run asked."""
    await _unknown(store, "c", "a", "b", expire_order=("a", "b", "c"))
    assert await _runs(store, _still_unknown, 1, 3) == [["a", "b", "c"]]
    await _unknown(store, "e", "d", expire_order=("d", "e"))
    assert await _runs(store, _still_unknown, 2, 3) == [["d", "e", "a"], ["b", "c", "d"]]


async def test_a_record_that_settles_is_not_asked_again(store: Store) -> None:
    await _unknown(store, "a", "b", "c")

    def answer(key: str) -> Reconciliation:
        return Happened.json(201, {"paid": key}) if key == "b" else StillUnknown()

    runs = await _runs(store, answer, 3, 2)
    assert runs == [["a", "b"], ["c", "a"], ["c", "a"]]
    states = await _updated(store, "a", "b", "c")
    assert [states[k][0] for k in "abc"] == [State.UNKNOWN, State.SUCCEEDED, State.UNKNOWN]


async def test_a_record_that_goes_unknown_again_is_asked_early_again(store: Store) -> None:
    """`a` was asked last (after `b`); a client's retry then took it over (the reconciler's
    NotHappened path) and its new lease lapsed: unknown again, under a new generation, it has
    not been asked in this life, and comes before `b` (which a stale stamp would not)."""
    await _unknown(store, "b", "a")
    assert await _runs(store, _still_unknown, 1, 2) == [["b", "a"]]
    summary = await store.describe(_key("a"))
    assert summary is not None
    generation = await store.takeover(_key("a"), summary.generation, State.UNKNOWN, 0.01)
    assert generation is not None
    await asyncio.sleep(0.05)
    assert await store.expire_lease(_key("a"), generation)
    assert await _runs(store, _still_unknown, 2, 1) == [["a"], ["b"]]


async def test_a_record_taken_over_meanwhile_is_not_stamped(store: Store) -> None:
    """The stamp is a compare-and-set on (generation, unknown): a record moved since it was
    asked about is left as it is."""
    await _unknown(store, "a")
    summary = await store.describe(_key("a"))
    assert summary is not None
    assert await store.takeover(_key("a"), summary.generation, State.UNKNOWN, 30) is not None
    assert not await store.mark_asked(_key("a"), summary.generation)
    assert not await store.mark_asked(_key("nobody"), summary.generation)


async def test_the_memory_store_and_postgresql_agree(pg_store: PostgresStore) -> None:
    def answer(key: str) -> Reconciliation | None:
        return {"b": Happened.json(201, {}), "d": None}.get(key, StillUnknown())

    seen = []
    for store in (MemoryStore(), pg_store):
        await _unknown(store, "e", "a", "d", "b", "c", expire_order=("a", "b", "c", "d", "e"))
        seen.append(await _runs(store, answer, 4, 2))
    assert seen[0] == seen[1]
    assert seen[0] == [["a", "b"], ["c", "d"], ["e", "a"], ["c", "d"]]


# --- the upgrade from schema 0011, with unknown records in it ---------------------------------


async def test_an_upgrade_from_0011_keeps_the_unknown_records_and_rotates(admin_dsn: str) -> None:
    name = f"idem_rot_{uuid.uuid4().hex[:12]}"
    dsn = await _fresh_database(admin_dsn, name)
    conn = await asyncpg.connect(dsn)
    try:
        await _apply_up_to(conn, 11)
        for age, key in ((30, "a"), (20, "b"), (10, "c")):
            await conn.execute(
                "INSERT INTO idem_requests (tenant, operation, idem_key, fingerprint, state,"
                " mode, retention, updated_at, generation, epoch, reopened_generation)"
                " VALUES ('tenant-a', $1, $2, '\\x00', 'unknown', 'lease', interval '1 day',"
                " now() - make_interval(secs => $3), nextval('idem_generation_seq'), NULL,"
                " NULL)",
                OP,
                key,
                float(age),
            )
        before = await conn.fetch("SELECT * FROM idem_requests ORDER BY idem_key")
        with pytest.raises(ConfigurationError, match="0012_reconcile_rotation"):
            await PostgresStore(dsn=dsn, listen=False).open()
        assert await migrate(conn) == [12]
        after = await conn.fetch("SELECT * FROM idem_requests ORDER BY idem_key")
        assert [dict(r) for r in after] == [
            {**dict(r), "reconcile_asked_at": None, "reconcile_asked_generation": None}
            for r in before
        ]
        async with PostgresStore(dsn=dsn, listen=False) as store:
            assert await _runs(store, _still_unknown, 2, 2) == [["a", "b"], ["c", "a"]]
        rows = await conn.fetch(
            "SELECT idem_key, state, updated_at, reconcile_asked_generation = generation AS mine"
            " FROM idem_requests ORDER BY idem_key"
        )
        assert [(r["idem_key"], r["state"], r["mine"]) for r in rows] == [
            ("a", "unknown", True),
            ("b", "unknown", True),
            ("c", "unknown", True),
        ]
        assert [r["updated_at"] for r in rows] == [r["updated_at"] for r in before]
    finally:
        await conn.close()
        admin = await asyncpg.connect(admin_dsn)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


def test_the_migration_adds_columns_and_nothing_else() -> None:
    """Adding nullable columns without a default rewrites nothing (no long table lock)."""
    [(_, name, text)] = [m for m in sql.migrations() if m[0] == 12]
    assert name == "reconcile_rotation"
    code = " ".join(line for line in text.splitlines() if not line.startswith("--"))
    assert "DEFAULT" not in code.upper()
    assert code.split() == [
        "ALTER",
        "TABLE",
        "idem_requests",
        "ADD",
        "COLUMN",
        "reconcile_asked_at",
        "timestamptz,",
        "ADD",
        "COLUMN",
        "reconcile_asked_generation",
        "bigint;",
    ]


# --- the command ---------------------------------------------------------------------------------


async def test_the_cron_d_command_reaches_the_newer_records(db_dsn: str, pool: Any) -> None:
    """`reconcile --limit 2`, run twice, over three records `tests.cli_app`'s reconciler cannot
    tell about (StillUnknown): the second run asks the newest, which the first left out."""
    for age, key in ((30, "x1"), (20, "x2"), (10, "x3")):
        await insert(pool, key, "unknown", age=age)

    async def stamps() -> dict[str, datetime | None]:
        rows = await pool.fetch("SELECT idem_key, reconcile_asked_at FROM idem_requests")
        return {r["idem_key"]: r["reconcile_asked_at"] for r in rows}

    first = cli("reconcile", "--app", "tests.cli_app:app", "--limit", "2", dsn=db_dsn)
    assert first.returncode == 0, first.stderr
    after_first = await stamps()
    assert after_first["x3"] is None
    assert None not in (after_first["x1"], after_first["x2"])
    second = cli("reconcile", "--app", "tests.cli_app:app", "--limit", "2", dsn=db_dsn)
    assert second.returncode == 0, second.stderr
    after_second = await stamps()
    assert after_second["x3"] is not None  # asked at last
    assert after_second["x1"] != after_first["x1"]  # then the least recently asked
    assert after_second["x2"] == after_first["x2"]
    states = await pool.fetch("SELECT DISTINCT state FROM idem_requests")
    assert [r["state"] for r in states] == ["unknown"]

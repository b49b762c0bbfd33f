"""A reconcile run whose move of one record the database refuses (a constraint or trigger on
idem_requests: the lapsed lease's `unknown` mark, a not-happened verdict's release) counts it
`refused`, logs it at ERROR and goes on to the others. The refusal escaped the run: it stopped
at that record, every run, and the records after it were never reconciled."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from idem_middleware import PostgresStore
from idem_middleware.ops import reconcile_unknown
from idem_middleware.reconcile import Happened, NotHappened, ReconcileContext, Reconciliation
from idem_middleware.store import Claimed
from idem_middleware.store.base import RecordKey, State

OP = "POST /refused-moves"
_UNDO = (
    "ALTER TABLE idem_requests DROP CONSTRAINT IF EXISTS operator_bad_stays;"
    "DROP TRIGGER IF EXISTS audited ON idem_requests; DROP FUNCTION IF EXISTS audited()"
)


@pytest.fixture
async def admin(db_dsn: str) -> AsyncIterator[asyncpg.Connection[Any]]:
    conn = await asyncpg.connect(db_dsn)
    try:
        await conn.execute(_UNDO + f"; DELETE FROM idem_requests WHERE operation = '{OP}'")
        yield conn
    finally:
        await conn.execute(_UNDO)
        await conn.close()


async def _lapsed(store: PostgresStore, admin: asyncpg.Connection[Any], name: str) -> RecordKey:
    key = RecordKey("tenant-a", OP, name)
    claim = await store.claim_lease(key, b"f" * 32, retention_seconds=60, lease_seconds=30)
    assert isinstance(claim, Claimed)
    await admin.execute(
        "UPDATE idem_requests SET lease_expires_at = now() - interval '1 second',"
        " created_at = created_at - make_interval(secs => $2) WHERE idem_key = $1",
        name,
        100.0 if name == "bad" else 0.0,  # (the bad one first, oldest)
    )
    return key


async def _reconciler(ctx: ReconcileContext) -> Reconciliation:
    return NotHappened() if ctx.key == "bad" else Happened.json(201, {"ok": True})


@pytest.mark.parametrize("refusing", ["unknown-mark", "release"])
async def test_a_refused_move_is_counted_and_the_run_goes_on(
    db_dsn: str, admin: asyncpg.Connection[Any], caplog: pytest.LogCaptureFixture, refusing: str
) -> None:
    async with PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False) as store:
        bad, good = await _lapsed(store, admin, "bad"), await _lapsed(store, admin, "good")
        if refusing == "unknown-mark":
            await admin.execute(
                "ALTER TABLE idem_requests ADD CONSTRAINT operator_bad_stays"
                " CHECK (state <> 'unknown' OR idem_key <> 'bad') NOT VALID"
            )
        else:  # a trigger that refuses a new generation (a not-happened verdict's release)
            await admin.execute(
                "CREATE FUNCTION audited() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN IF"
                " NEW.generation <> OLD.generation THEN RAISE EXCEPTION ''audited elsewhere'';"
                " END IF; RETURN NEW; END';"
                "CREATE TRIGGER audited BEFORE UPDATE ON idem_requests FOR EACH ROW"
                " EXECUTE FUNCTION audited()"
            )
        with caplog.at_level(logging.ERROR, logger="idem_middleware"):
            report = await reconcile_unknown(store, {OP: _reconciler}, seconds=5)
        good_record, bad_record = await store.get(good), await store.get(bad)
    assert report.refused == 1
    assert good_record is not None
    assert good_record.state is State.SUCCEEDED  # reconciled, after the refused one
    assert bad_record is not None
    assert bad_record.state is (State.PENDING if refusing == "unknown-mark" else State.UNKNOWN)
    assert "the database refused a record's move" in caplog.text

"""Mutants of reconcile_batch.py's `_fields` (a record's log fields, written once) killed: the
lines of a refused move and of a refused stamp carry the tenant, operation, generation and the
key's digest in their `extra`, and never the raw key, in the message or a field."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from idem_middleware import MemoryStore
from idem_middleware.context import key_digest
from idem_middleware.errors import StatementRefused
from idem_middleware.ops import reconcile_unknown
from idem_middleware.reconcile import NotHappened, ReconcileContext, StillUnknown
from idem_middleware.store import Claimed
from idem_middleware.store.base import RecordKey

pytestmark = pytest.mark.asyncio

OP = "POST /payouts"
KEY = RecordKey("tenant-a", OP, "raw-key-4111111111111111")


class _Refusing(MemoryStore):
    """A memory store whose database refuses `what`: a NotHappened verdict's move, or a stamp."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    async def allow_retry(self, key: RecordKey, generation: int, note: str) -> bool:
        if self.what == "move":
            raise StatementRefused("a trigger said no")
        return await super().allow_retry(key, generation, note)

    async def mark_asked(self, key: RecordKey, generation: int) -> bool:
        if self.what == "stamp":
            raise StatementRefused("a trigger said no")
        return await super().mark_asked(key, generation)


def _verdict(what: str) -> Any:
    async def reconciler(ctx: ReconcileContext) -> Any:
        return NotHappened() if what == "move" else StillUnknown()

    return reconciler


@pytest.mark.parametrize(
    ("what", "said"),
    [("move", "refused a record's move"), ("stamp", "refused to stamp")],
)
async def test_a_refused_records_line_has_its_fields_and_not_its_key(
    what: str, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = _Refusing(what)
    claim = await store.claim_lease(KEY, b"f" * 32, retention_seconds=60, lease_seconds=0.01)
    assert isinstance(claim, Claimed)
    await asyncio.sleep(0.05)
    assert await store.expire_lease(KEY, claim.generation)
    caplog.set_level(logging.WARNING, logger="idem_middleware")
    await reconcile_unknown(store, {OP: _verdict(what)}, seconds=5)
    [record] = [r for r in caplog.records if said in r.getMessage()]
    fields = {
        name: getattr(record, name, None)
        for name in ("tenant", "operation", "key_digest", "generation")
    }
    assert fields == {
        "tenant": "tenant-a",
        "operation": OP,
        "key_digest": key_digest(KEY.key),
        "generation": claim.generation,
    }
    for value in (record.getMessage(), *map(str, vars(record).values())):
        assert KEY.key not in value

"""The status resource asked about a released record (an operator or a reconciler freed the key
for a retry) from a 202's Location whose request differs from the original's: the key is free,
so that request's retry runs it. It reads `pending` with `"retry": true`, what to do next, never
`422 key-reused` ("yours did not run. Use a new key"), which would send the client to a new key
and could run the effect twice."""

from __future__ import annotations

from typing import Any

from idem_middleware import PostgresStore
from idem_middleware.answers import request_digest
from idem_middleware.store.base import Claimed, RecordKey, Settlement, State
from tests.apps import build_app, client

OP = "POST /payouts"
STATUS = "/idempotency/status"


async def test_a_released_record_is_never_another_requests(
    pg_store: PostgresStore, pool: Any
) -> None:
    store = pg_store
    key = RecordKey("tenant-a", OP, "released")
    original = bytes(range(1, 33))
    claimed = await store.claim_lease(key, original, retention_seconds=60.0, lease_seconds=30.0)
    assert isinstance(claimed, Claimed)
    unknown = Settlement(State.UNKNOWN, None)
    assert await store.settle(key, claimed.generation, State.PENDING, unknown)
    assert await store.allow_retry(key, claimed.generation, "the bank has no such payout")
    other = request_digest(bytes(32))
    assert other != request_digest(original)
    async with client(build_app(store)) as c:
        answer = await c.get(STATUS, params={"operation": OP, "key": "released", "request": other})
    assert answer.status_code == 200, answer.text
    assert (answer.json()["state"], answer.json()["retry"]) == ("pending", True)

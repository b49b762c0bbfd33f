"""A transactional route that never waits for a concurrent claim (`wait_seconds=0`) still
claims, runs and replays its requests: the claim's statements are given the little time they
need to run (sessions._MIN_STATEMENT_TIMEOUT), not refused at once by asyncpg's zero timeout,
on the fast path and the ordinary one."""

from __future__ import annotations

import pytest

from idem_middleware import Policy, PostgresStore
from tests.apps import build_app, client, key


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast", "ordinary"])
async def test_a_route_that_never_waits_claims_and_replays(db_dsn: str, fast_path: bool) -> None:
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False, fast_path=fast_path)
    app = build_app(store, default_policy=Policy(wait_seconds=0.0))
    async with store, client(app) as c:
        first = await c.post(
            "/accounts/a1/credits", json={"amount": 1}, headers=key(f"nw-{fast_path}")
        )
        again = await c.post(
            "/accounts/a1/credits", json={"amount": 1}, headers=key(f"nw-{fast_path}")
        )
    assert first.status_code == 201, first.text
    assert again.status_code == 201, again.text
    assert again.headers.get("idempotent-replayed") == "true"
    assert app.state.probe.calls == 1

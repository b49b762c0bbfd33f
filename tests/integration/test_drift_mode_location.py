"""Two processes (two apps, each with its own store object on one database) guard `POST
/payouts` in different modes, as in a deploy that changes the route's mode (docs/operating.md,
"Rolling upgrades and rollbacks"). A lease-mode duplicate that finds the key held by the other
version's uncommitted transactional claim cannot compare its request with the original's yet:
when its wait runs out, its `202`'s `Location` carries its own request's digest, as a
transactional duplicate's does (`answers.InFlight.fingerprint`), so that the status resource
tells it `422 key-reused` once the original's record shows another request, instead of
"finished: send it again for its response".
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import asyncpg
import pytest

from idem_middleware import Mode, PostgresStore
from tests.apps import (
    BOUND,
    LEASE_POLICY,
    Step,
    assert_problem,
    build_lease_app,
    client,
    count,
)
from tests.integration.test_lease_mode import (
    BODY,
    bank,  # noqa: F401 (a fixture)
    finish,
    post,
    probe_of,
    spawn,
)

TRANSACTIONAL = LEASE_POLICY.replace(mode=Mode.TRANSACTIONAL)
ACCEPTING = LEASE_POLICY.replace(accept_while_in_flight=True, wait_seconds=0.3)


@pytest.fixture
async def other_store(db_target: tuple[str, dict[str, Any]]) -> AsyncIterator[PostgresStore]:
    """The other process's store: its own object and pool on the same database."""
    dsn, options = db_target
    async with PostgresStore(dsn=dsn, min_size=1, max_size=4, **options) as store:
        yield store


@pytest.mark.parametrize(("body", "verdict"), [(BODY, 200), ({**BODY, "amount": 7}, 422)])
async def test_a_lease_duplicate_of_a_transactional_claim_is_told_apart_by_its_location(
    pg_store: PostgresStore,
    other_store: PostgresStore,
    bank: asyncpg.Pool[Any],  # noqa: F811
    body: dict[str, Any],
    verdict: int,
) -> None:
    old = build_lease_app(pg_store, bank, TRANSACTIONAL)
    new = build_lease_app(other_store, bank, ACCEPTING)
    gate = asyncio.Event()
    probe_of(old).steps = [Step(fence="before", gate=gate)]
    async with client(old) as c_old, client(new) as c_new:
        original = spawn(post(c_old))
        await asyncio.wait_for(probe_of(old).entered.wait(), BOUND)
        accepted = await post(c_new, body=body)
        assert accepted.status_code == 202, accepted.text
        location = accepted.headers["location"]
        assert "request" in parse_qs(urlsplit(location).query), location
        gate.set()
        assert (await finish(original)).status_code == 201
        status = await c_new.get(location)
        if verdict == 422:
            assert_problem(status, 422, "key-reused")
            assert_problem(await post(c_new, body=body), 422, "key-reused")
        else:
            assert status.status_code == 200, status.text
            assert status.json()["state"] == "succeeded"
    assert probe_of(new).calls == 0
    assert await count(bank, "test_ledger") == 1

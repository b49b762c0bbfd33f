"""Two processes (two apps, each with its own store object on one database) serve `POST /pay`
with policies that differ in what they accept before a claim, or in whether they guard the
route at all (docs/operating.md, "Rolling upgrades and rollbacks"): what a retry of a request
one of them ran gets from the other.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import Policy, PostgresStore
from tests.apps import assert_problem, assert_replay_of, client, key, one_route_app

PAY = "/pay"
BODY = {"account": "acc-1", "amount": 100, "note": "rent"}


@pytest.fixture
async def other_store(db_target: tuple[str, dict[str, Any]]) -> AsyncIterator[PostgresStore]:
    """The other process's store: its own object and pool on the same database."""
    dsn, options = db_target
    async with PostgresStore(dsn=dsn, min_size=1, max_size=4, **options) as store:
        yield store


def pay_app(store: PostgresStore, runs: list[str], name: str, **options: Any) -> Any:
    """`POST /pay` behind the middleware; each run appends `name` to `runs`."""

    async def pay(request: Request) -> Response:
        runs.append(name)
        return JSONResponse({"paid": (await request.json())["amount"], "run": len(runs)}, 201)

    return one_route_app(PAY, pay, store=store, **options)


@pytest.mark.parametrize(
    ("change", "status", "kind"),
    [
        ({"max_body_bytes": 16}, 413, "body-too-large"),
        ({"max_json_values": 2}, 400, "too-many-fields"),
        ({"max_response_bytes": 0}, 201, None),  # what is stored is the recording version's
    ],
)
async def test_a_lowered_limit_refuses_a_retry_the_other_version_ran(
    pg_store: PostgresStore,
    other_store: PostgresStore,
    change: dict[str, Any],
    status: int,
    kind: str | None,
) -> None:
    runs: list[str] = []
    old = pay_app(pg_store, runs, name="old", policies={f"POST {PAY}": Policy()})
    new = pay_app(other_store, runs, name="new", policies={f"POST {PAY}": Policy(**change)})
    async with client(old) as c_old, client(new) as c_new:
        first = await c_old.post(PAY, json=BODY, headers=key("k1"))
        assert first.status_code == 201, first.text
        retried = await c_new.post(PAY, json=BODY, headers=key("k1"))
        if kind is None:
            assert_replay_of(retried, first)
        else:
            assert_problem(retried, status, kind)  # refused before any claim: nothing ran
        assert_replay_of(await c_old.post(PAY, json=BODY, headers=key("k1")), first)
    assert runs == ["old"]


@pytest.mark.parametrize(
    "unguarded",
    [
        {"policies": {f"POST {PAY}": Policy(guard=False)}},
        {"methods": ("PATCH",)},  # POST left out of `methods`, no policy of its own
    ],
)
async def test_a_version_that_does_not_guard_the_route_runs_a_retry_again(
    pg_store: PostgresStore, other_store: PostgresStore, unguarded: dict[str, Any]
) -> None:
    """The documented hazard of a route no longer guarded: nothing in the database can stop
    the version that does not guard it, so each version runs the key once."""
    runs: list[str] = []
    old = pay_app(pg_store, runs, name="old", policies={f"POST {PAY}": Policy()})
    new = pay_app(other_store, runs, name="new", **unguarded)
    async with client(old) as c_old, client(new) as c_new:
        assert (await c_old.post(PAY, json=BODY, headers=key("k1"))).status_code == 201
        again = await c_new.post(PAY, json=BODY, headers=key("k1"))
        assert again.status_code == 201
        assert "idempotent-replayed" not in again.headers
        # The other way round: the unguarded version ran it first, and left no record.
        assert (await c_new.post(PAY, json=BODY, headers=key("k2"))).status_code == 201
        guarded = await c_old.post(PAY, json=BODY, headers=key("k2"))
        assert "idempotent-replayed" not in guarded.headers
    assert runs == ["old", "new", "new", "old"]

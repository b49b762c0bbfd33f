"""Operators' commands racing live requests on the same key, on PostgreSQL, and the arguments
they refuse: the effect never runs twice, the client's answer is true, no key is wedged, and the
operator is told what happened.

Found by probing: a key a transactional request was running (its claim holds the key's lock, its
record is written only at its commit) was answered "no record holds this key (check the tenant,
the operation and the key; a finished record is purged after its retention)" by `show`,
`resolve` and `reopen`: the operator was sent looking for a typo or a purge while the request
ran. And an option of `show`, `resolve` or `reopen` given twice (`--key a --key b`, `--to
succeeded --to retry`) was taken silently, the last one winning: a resolve acted on another
record, or to another state, than the one the operator also named.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import Mode, Policy, StaleGeneration, get_context
from idem_middleware.ops import Resolution, ResolveError, operator_response, reopen, resolve
from idem_middleware.store.base import RecordKey, State, Store
from tests.apps import LEASE_POLICY, LEDGER_INSERT, client, count, one_route_app
from tests.integration.test_cli import cli, insert

KEY = RecordKey("tenant-a", "POST /payouts", "k1")
BODY = {"account": "acc-1", "amount": 10}
#: A lease long enough that no renewal lands while a test runs (one is due after a third of it):
#: the tests lapse it by hand.
LEASE = LEASE_POLICY.replace(lease_seconds=30.0, wait_seconds=0.3)
TRANSACTIONAL = Policy(mode=Mode.TRANSACTIONAL)
RECORD = ("--tenant", "tenant-a", "--operation", "POST /payouts", "--key", "k1")


class Gated:
    """A handler that writes a ledger row (on the claim's connection, or the fenced one) and
    then waits for `gate`; `calls` counts its runs."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()
        self.calls = 0

    async def handle(self, request: Request) -> Response:
        self.calls += 1
        ctx = get_context(request)
        conn = ctx.connection if ctx.mode is Mode.TRANSACTIONAL else await ctx.fenced_connection()
        await conn.execute(LEDGER_INSERT, ctx.tenant, "acc-1", 10)
        self.entered.set()
        await self.gate.wait()
        return JSONResponse({"call": self.calls}, status_code=201)


def _post(c: httpx.AsyncClient) -> Any:
    return c.post("/payouts", json=BODY, headers={"idempotency-key": "k1"})


@asynccontextmanager
async def running(store: Store, policy: Policy) -> AsyncIterator[tuple[Gated, Any, Any]]:
    """A request on KEY whose handler made its write and waits at its gate: (the handler, the
    client, the request's task). The gate is opened on the way out, whatever happened."""
    handler = Gated()
    app = one_route_app("/payouts", handler.handle, store=store, policies={"POST /payouts": policy})
    async with client(app) as c:
        task = asyncio.ensure_future(_post(c))
        try:
            await asyncio.wait_for(handler.entered.wait(), 5)
            yield handler, c, task
        finally:
            handler.gate.set()
            await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 5)


# -- a transactional request running: the operator is told so -------------------------------------


async def test_resolve_and_reopen_of_a_key_a_transactional_request_runs_say_so(
    pg_store: Store, pool: Any
) -> None:
    created = operator_response(Resolution.SUCCEEDED, 201, b"{}")
    async with running(pg_store, TRANSACTIONAL) as (handler, _, task):
        with pytest.raises(ResolveError, match="a request is running this key now"):
            await resolve(pg_store, KEY, Resolution.SUCCEEDED, note="x", response=created)
        with pytest.raises(ResolveError, match="a request is running this key now"):
            await reopen(pg_store, KEY, note="x")
        handler.gate.set()
        first = await asyncio.wait_for(task, 5)
        assert first.status_code == 201, first.text
    # The request's own outcome stands, written once.
    record = await pg_store.get(KEY)
    assert record is not None
    assert record.state is State.SUCCEEDED
    assert record.response is not None
    assert record.response.body == b'{"call":1}'
    assert await count(pool, "test_ledger") == 1
    # Once it committed, the usual answers.
    with pytest.raises(ResolveError, match="only unknown records"):
        await resolve(pg_store, KEY, Resolution.SUCCEEDED, note="x", response=created)


async def test_a_key_nobody_holds_is_still_not_found(pg_store: Store) -> None:
    with pytest.raises(ResolveError, match="no record holds this key"):
        await reopen(pg_store, KEY, note="x")


async def test_cli_show_of_a_key_a_transactional_request_runs_says_so(
    db_dsn: str, pg_store: Store
) -> None:
    async with running(pg_store, TRANSACTIONAL):
        shown = await asyncio.to_thread(cli, "show", *RECORD, dsn=db_dsn)
        as_json = await asyncio.to_thread(cli, "show", *RECORD, "--json", dsn=db_dsn)
        resolved = await asyncio.to_thread(
            cli, "resolve", *RECORD, "--to", "succeeded", "--status", "201", "--note", "x",
            dsn=db_dsn,
        )  # fmt: skip
    assert shown.returncode == 1, shown.stderr
    assert "a request is running this key now" in shown.stdout
    assert as_json.returncode == 1, as_json.stderr
    assert json.loads(as_json.stdout) == {"found": False, "running": True}
    assert resolved.returncode == 1
    assert "a request is running this key now" in resolved.stderr
    assert "Traceback" not in resolved.stderr
    gone = await asyncio.to_thread(cli, "show", *RECORD[:-1], "k2", "--json", dsn=db_dsn)
    assert gone.returncode == 1
    assert json.loads(gone.stdout) == {"found": False, "running": False}


# -- a lease-mode handler whose lease lapsed while it ran: what the operator decides holds --------


async def _lapse(pool: Any) -> None:
    await pool.execute(
        "UPDATE idem_requests SET lease_expires_at = now() - interval '1 second' "
        "WHERE idem_key = 'k1'"
    )


@pytest.mark.parametrize("to", list(Resolution))
async def test_resolving_a_lapsed_lease_its_handler_still_runs(
    pg_store: Store, pool: Any, to: Resolution
) -> None:
    """The lease lapsed under a live handler (after its effect), and the operator resolves it:
    the handler's fenced write is refused, its client is told to retry, and the retry gets the
    operator's outcome (or, resolved to a retry, runs once more: one ledger row either way)."""
    answers = {Resolution.SUCCEEDED: 201, Resolution.FAILED_FINAL: 402}
    response = None if to is Resolution.RETRY else operator_response(to, answers[to], b'{"h":1}')
    # (The handler opens its fenced connection after its gate: the lapse, made by hand, would
    # wait for that connection's row lock.)
    handler_after = _FencedAfterGate()
    app = one_route_app(
        "/payouts", handler_after.handle, store=pg_store, policies={"POST /payouts": LEASE}
    )
    async with client(app) as c:
        first = asyncio.ensure_future(_post(c))
        await asyncio.wait_for(handler_after.entered.wait(), 5)
        await _lapse(pool)
        move = await resolve(pg_store, KEY, to, note="checked", response=response)
        assert move.before is State.PENDING
        handler_after.gate.set()
        answer = await asyncio.wait_for(first, 5)
        assert answer.status_code == 409, answer.text  # lost its claim: retry for the outcome
        retry = await _post(c)
    if to is Resolution.RETRY:
        assert retry.status_code == 201, retry.text
        assert handler_after.calls == 2
        assert await count(pool, "test_ledger") == 1  # the second run's; the first was refused
    else:
        assert retry.status_code == answers[to]
        assert retry.json() == {"h": 1}
        assert handler_after.calls == 1
        assert await count(pool, "test_ledger") == 0  # the late fenced write was refused


class _FencedAfterGate(Gated):
    async def handle(self, request: Request) -> Response:
        self.calls += 1
        ctx = get_context(request)
        if self.calls == 1:
            self.entered.set()
            await self.gate.wait()
        with contextlib.suppress(StaleGeneration):  # (the late executor's write: refused)
            conn = await ctx.fenced_connection()
            await conn.execute(LEDGER_INSERT, ctx.tenant, "acc-1", 10)
        return JSONResponse({"call": self.calls}, status_code=201)


# -- purge and a live request on an expired record ------------------------------------------------


@pytest.mark.parametrize("policy", [TRANSACTIONAL, LEASE], ids=["transactional", "lease"])
async def test_purge_passes_over_an_expired_record_a_request_is_reclaiming(
    pg_store: Any, pool: Any, policy: Policy
) -> None:
    await pool.execute(
        "INSERT INTO idem_requests (tenant, operation, idem_key, fingerprint, state, mode, "
        "retention, expires_at, response_status) VALUES ('tenant-a', 'POST /payouts', 'k1', "
        "'\\x00', 'succeeded', $1, interval '1 day', now() - interval '1 hour', 201)",
        policy.mode.value,
    )
    async with running(pg_store, policy) as (handler, c, task):
        assert await asyncio.wait_for(pg_store.purge(batch_size=10, max_batches=10), 5) == 0
        handler.gate.set()
        first = await asyncio.wait_for(task, 5)
        assert first.status_code == 201, first.text
        retry = await _post(c)
    assert retry.status_code == 201
    assert retry.headers.get("idempotent-replayed") == "true"
    assert handler.calls == 1
    assert await count(pool, "test_ledger") == 1


# -- options given twice --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ("resolve", *RECORD, "--key", "k2", "--to", "retry", "--note", "x"),
        ("resolve", *RECORD, "--to", "succeeded", "--to", "retry", "--note", "x"),
        ("resolve", *RECORD, "--to", "failed_final", "--status", "402", "--status", "404",
         "--note", "x"),
        ("resolve", *RECORD, "--to", "retry", "--note", "x", "--note", "y"),
        ("reopen", *RECORD, "--tenant", "t", "--note", "x"),
        ("show", "--operation", "POST /x", *RECORD),
    ],
    ids=["key", "to", "status", "note", "tenant", "operation"],
)  # fmt: skip
async def test_an_option_given_twice_is_refused_and_nothing_changes(
    db_dsn: str, pool: Any, argv: tuple[str, ...]
) -> None:
    await insert(pool, "k1", "unknown")
    await insert(pool, "k2", "unknown")
    before = await pool.fetch("SELECT idem_key, state, generation FROM idem_requests ORDER BY 1")
    result = await asyncio.to_thread(cli, *argv, dsn=db_dsn)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "given more than once" in result.stderr
    assert "Traceback" not in result.stderr
    after = await pool.fetch("SELECT idem_key, state, generation FROM idem_requests ORDER BY 1")
    assert after == before


async def test_options_given_once_still_work(db_dsn: str, pool: Any) -> None:
    await insert(pool, "k1", "unknown")
    argv = ("resolve", "--tenant", "t", "--operation", "POST /payouts", "--key", "k1")
    result = await asyncio.to_thread(cli, *argv, "--to", "retry", "--note", "x", dsn=db_dsn)
    assert result.returncode == 0, result.stderr
    listed = await asyncio.to_thread(
        cli, "list", "--state", "pending", "--state", "unknown", dsn=db_dsn
    )
    assert listed.returncode == 0, listed.stderr  # (`--state` is repeatable, as documented)

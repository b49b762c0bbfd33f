"""Differential test: one app, one random sequence of requests, on `MemoryStore` and on a real
`PostgresStore`; every step must answer alike on both (docs/testing.md: the twin is what users'
tests run on, so it must behave as PostgreSQL does).

The app: transactional routes (`/tx/a`; `/tx/b` with a short wait, so a duplicate of a request
still running gets 409), lease-mode routes (`/lease/u`: a lapsed lease becomes unknown;
`/lease/t`: taken over, and `202` + `Location` when the wait runs out; `/lease/r`: unknown, with
a reconciler whose verdict depends on the effects so far) and routes that take only one-time
tokens (`/tok` transactional, `/tokl` lease), plus the status resource. A handler's status, body
and headers depend on the request (its JSON body says what to answer: a status, a body over
`max_response_bytes`, a stream, an event stream, an exception, a 503 every other run) and on a
counter of its effects per key.

A step sends one request (same and other keys, bodies, tenants, routes; tokens for the route,
another route or another tenant, fresh from the issuer or sent again), a duplicate while the
first still runs (same or other body), a lease that lapses under a running handler before its
retry, a GET of a `Location` the status resource gave; or makes an operator move
(`ops.resolve` / `ops.reopen`, `store.purge`), or moves time (the twin's clock; PostgreSQL's
stored deadlines by SQL, as docs/testing.md says). After every step it compares: status, headers
(`Idempotent-Replayed` ...), body, effects per key, every touched key's record (state, stored
response, expired / lease-expired / retry-allowed, generation and epoch by the order they were
first seen, mode, audit trail without its time stamps), `list_records` and `stats`.

`DIFF_SEEDS` (default 3) and `DIFF_STEPS` (default 60) run more by hand:
`DIFF_SEEDS=200 DIFF_STEPS=120 pytest tests/integration/test_differential_stores.py`.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, LeaseExpiry, Mode, Policy
from idem_middleware.ops import Resolution, operator_response, reopen, resolve
from idem_middleware.reconcile import (
    Happened,
    NotHappened,
    ReconcileContext,
    Reconciliation,
    StillUnknown,
)
from idem_middleware.status import status_route
from idem_middleware.store import MemoryStore, RecordKey, State
from idem_middleware.store.postgres import PostgresStore
from idem_middleware.tokens import TokenIssuer
from tests.contract import FakeClock

SECRET = b"s" * 32
TENANTS = ("t1", "t2")
KEYS = ("k0", "k1", "k2")
ROUTES = ("/tx/a", "/tx/b", "/lease/u", "/lease/t", "/lease/r", "/tok", "/tokl")
TOKEN_ROUTES = ("/tok", "/tokl")
RETENTION = 3000.0
SHORT_WAIT = ("/tx/b", "/lease/t")
CAP = 2048
STATUSES = (200, 201, 302, 400, 402, 404, 409, 418, 422, 429, 500, 503)
KINDS = ("json", "json", "json", "big", "stream", "sse", "raise", "flaky")
SEEDS = int(os.environ.get("DIFF_SEEDS", "3"))
STEPS = int(os.environ.get("DIFF_STEPS", "60"))


class Effects:
    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str, str]] = Counter()


def _tenant(scope: Any) -> str | None:
    return dict(scope["headers"]).get(b"x-tenant", b"").decode() or None


def make_app(store: Any, effects: Effects) -> Starlette:
    async def handler(request: Request) -> Response:
        spec = json.loads(await request.body())
        where = (
            request.headers.get("x-tenant", ""),
            request.url.path,
            request.headers.get("idempotency-key", ""),
        )
        hold = float(request.headers.get("x-hold", "0"))
        if hold:
            await asyncio.sleep(hold)
        effects.counts[where] += 1
        count = effects.counts[where]
        kind, status = spec["kind"], spec["status"]
        if kind == "raise":
            raise RuntimeError("boom")
        if kind == "flaky":  # fails every other run
            status = 503 if count % 2 else status
        headers = {"x-count": str(count), "x-v": str(spec["v"])}
        if kind == "big":
            return Response(b"x" * (CAP + 1), status_code=status, headers=headers)
        if kind in ("stream", "sse"):

            async def chunks() -> AsyncIterator[bytes]:
                for i in range(3):
                    yield f"data: {i} {count}\n\n".encode()

            media = "text/event-stream" if kind == "sse" else "text/plain"
            return StreamingResponse(
                chunks(), status_code=status, headers=headers, media_type=media
            )
        body = {"v": spec["v"], "count": count, "status": status}
        return JSONResponse(body, status_code=status, headers=headers)

    async def reconciler(ctx: ReconcileContext) -> Reconciliation:
        # What the downstream system says, from what the handlers did under the key.
        runs = sum(
            n
            for (_, path, key), n in effects.counts.items()
            if key == ctx.key and path == "/lease/r"
        )
        if runs % 3 == 0:
            return StillUnknown("not yet")
        if runs % 3 == 1:
            return Happened.json(201, {"reconciled": runs})
        return NotHappened()

    base = Policy(retention_seconds=RETENTION, max_response_bytes=CAP, wait_seconds=3.0)
    lease = base.replace(mode=Mode.LEASE, lease_seconds=30.0)
    policies = {
        "POST /tx/a": base,
        "POST /tx/b": base.replace(wait_seconds=0.1),
        "POST /lease/u": lease,
        "POST /lease/t": lease.replace(
            on_lease_expiry=LeaseExpiry.TAKEOVER, wait_seconds=0.1, accept_while_in_flight=True
        ),
        "POST /lease/r": lease.replace(reconciler=reconciler),
        "POST /tokl": lease.replace(require_token=True, wait_seconds=0.1),
        "POST /tok": base.replace(require_token=True),
    }
    return Starlette(
        routes=[
            *(Route(path, handler, methods=["POST"]) for path in ROUTES),
            status_route(store, tenant_resolver=_tenant),
        ],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=store,
                policies=policies,
                tenant_resolver=lambda scope: (
                    dict(scope["headers"]).get(b"x-tenant", b"").decode() or None
                ),
            )
        ],
    )


@dataclass
class Side:
    name: str
    store: Any
    effects: Effects
    client: httpx.AsyncClient
    issuer: TokenIssuer
    clock: FakeClock | None = None
    pool: asyncpg.Pool[Any] | None = None
    #: Each generation (or epoch) seen, by the order it was first seen in: the stores' own
    #: numbers differ, their order and sharing must not.
    ordinals: dict[int, int] = field(default_factory=dict)
    #: The last token each intent was issued (a client may send it again without asking).
    tokens: dict[tuple[str, str, str], str] = field(default_factory=dict)

    def ordinal(self, generation: int | None) -> int | None:
        if generation is None:
            return None
        return self.ordinals.setdefault(generation, len(self.ordinals))

    async def shift(self, seconds: float) -> None:
        """Move the store's time `seconds` on (PostgreSQL: every stored deadline back)."""
        if self.clock is not None:
            self.clock.now += seconds
            return
        assert self.pool is not None
        for column in ("expires_at", "lease_expires_at", "created_at", "updated_at"):
            await self.pool.execute(
                f"UPDATE idem_requests SET {column} = {column} - make_interval(secs => $1::float8)"
                f" WHERE {column} IS NOT NULL",
                seconds,
            )
        await self.pool.execute(
            "UPDATE idem_tokens SET expires_at = expires_at - make_interval(secs => $1::float8)",
            seconds,
        )


def _answer(response: httpx.Response) -> tuple[Any, ...]:
    skip = {"date", "server"}
    headers = sorted((k, v) for k, v in response.headers.items() if k not in skip)
    return (response.status_code, headers, response.content)


async def _outcome(coro: Any) -> Any:
    try:
        result = await coro
    except Exception as exc:
        return ("raised", type(exc).__name__, str(exc))
    return ("ok", result)


async def _token(side: Side, tenant: str, operation: str, intent: str, reuse: bool) -> str:
    kept = side.tokens.get((tenant, operation, intent))
    if reuse and kept is not None:
        return kept
    try:
        # (k2's token lives shorter than a long shift of the clock)
        ttl = 3500.0 if intent == "k2" else None
        issued = await side.issuer.issue(tenant, operation, intent_id=intent, ttl_seconds=ttl)
        side.tokens[(tenant, operation, intent)] = issued.token
        return issued.token
    except Exception as exc:
        return f"refused-{type(exc).__name__}"


async def _record(side: Side, key: RecordKey) -> Any:
    record = await side.store.get(key)
    summary = await side.store.describe(key)
    if record is None:
        return (None, summary is None)
    response = record.response
    return (
        record.state.value,
        side.ordinal(record.generation),
        side.ordinal(record.epoch),
        record.fingerprint.hex(),
        None if response is None else (response.status, response.body, sorted(response.headers)),
        record.expired,
        record.lease_expired,
        record.retry_allowed,
        None if summary is None else (summary.mode, _lines(summary.note), summary.reopened),
        None if summary is None else summary.response_status,
    )


async def _listing(side: Side) -> Any:
    summaries = await side.store.list_records(states=list(State), limit=1000)
    listed = sorted(
        (
            tuple(x.key),
            x.state.value,
            x.mode,
            x.response_status,
            x.lease_expired,
            x.reopened,
            _lines(x.note),
            x.lease_expires_at is None,
            x.expires_at is None,
        )
        for x in summaries
    )
    stats = await side.store.stats()
    unresolved = await side.store.stats(unresolved_only=True)
    return listed, stats.counts, stats.lapsed_leases, unresolved.counts, unresolved.lapsed_leases


def _lines(note: str | None) -> list[str] | None:
    """An audit trail without its time stamps (each store stamps its own wall time)."""
    return None if note is None else [line.split(" ", 1)[1] for line in note.splitlines()]


def _request(rng: random.Random, templates: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "route": rng.choice(ROUTES),
        "tenant": rng.choice(TENANTS) if rng.random() < 0.97 else "",
        "key": rng.choice(KEYS),
        "spec": rng.choice(templates),
        "token_tenant": rng.choice(TENANTS) if rng.random() < 0.2 else None,
        "missing_key": rng.random() < 0.03,
        "reuse_token": rng.random() < 0.5,
        "token_route": None if rng.random() < 0.85 else rng.choice(TOKEN_ROUTES),
    }


async def _send(
    side: Side, req: dict[str, Any], hold: float = 0.0, locations: set[Any] | None = None
) -> tuple[Any, ...]:
    headers = {"content-type": "application/json"}
    if req["tenant"]:
        headers["x-tenant"] = req["tenant"]
    key = req["key"]
    if req["route"] in TOKEN_ROUTES:
        tenant = req["token_tenant"] or req["tenant"] or "t1"
        operation = f"POST {req['token_route'] or req['route']}"
        key = await _token(side, tenant, operation, key, req["reuse_token"])
    if not req["missing_key"]:
        headers["idempotency-key"] = key
    if hold:
        headers["x-hold"] = str(hold)
    response = await side.client.post(
        req["route"], content=json.dumps(req["spec"]), headers=headers
    )
    return _answer(response)


async def _touched(side: Side, req: dict[str, Any]) -> list[RecordKey]:
    key = req["key"]
    if req["route"] in TOKEN_ROUTES:  # (the token is the key: an intent's is the same on both)
        tenant = req["token_tenant"] or req["tenant"] or "t1"
        key = side.issuer._token_for(tenant, f"POST {req['token_route'] or req['route']}", key)
    return [RecordKey(req["tenant"], f"POST {req['route']}", key)]


async def _step(
    rng: random.Random,
    sides: list[Side],
    templates: list[dict[str, Any]],
    seen: set[RecordKey],
    locations: set[tuple[str, str]],
) -> tuple[str, list[Any]]:
    roll = rng.random()
    results: list[Any] = []
    if roll < 0.06 and locations:
        tenant, location = rng.choice(sorted(locations))
        if rng.random() < 0.2:
            tenant = rng.choice(TENANTS)
        for s in sides:
            answer = await s.client.get(location, headers={"x-tenant": tenant})
            results.append(_answer(answer))
        return f"status {tenant} {location}", results
    if roll < 0.08:
        seconds = rng.choice((100.0, 2000.0, 4000.0))
        for s in sides:
            await s.shift(seconds)
        return f"shift {seconds}", [None, None]
    if roll < 0.12:
        return "purge", [await _outcome(s.store.purge()) for s in sides]
    if roll < 0.22 and seen:
        move = rng.choice(("succeeded", "failed_final", "retry", "reopen"))
        wanted = ("succeeded", "failed_final") if move == "reopen" else ("unknown", "pending")
        states = {k: (await _record(sides[0], k))[0] for k in sorted(seen)}
        fitting = [k for k, state in states.items() if state in wanted]
        key = rng.choice(fitting if fitting and rng.random() < 0.8 else sorted(seen))
        again = rng.random() < 0.3
        status = 201 if move == "succeeded" else 402
        to = Resolution.SUCCEEDED if move == "succeeded" else Resolution.FAILED_FINAL
        response = operator_response(to, status, b'{"by": "hand"}')
        for s in sides:
            if move == "reopen":
                call = reopen(s.store, key, note="diff")
            else:
                given = None if move == "retry" else response
                call = resolve(s.store, key, move, note="diff", response=given, again=again)
            results.append(await _outcome(call))
        return f"{move} again={again} {key}", results
    req = _request(rng, templates)
    if req["tenant"] and not req["missing_key"]:
        seen.update(await _touched(sides[0], req))
    if roll < 0.32:
        # The first holds its key; the second waits for it (replayed, or run once it released
        # the key) or, on a route with a short wait, gets 409 while it still runs.
        hold = 0.5 if req["route"] in SHORT_WAIT else 0.05
        other = {**req, "spec": rng.choice(templates)} if rng.random() < 0.3 else req
        for s in sides:
            first = asyncio.ensure_future(_send(s, req, hold=hold))
            await asyncio.sleep(0.02)
            second = await _send(s, other, locations=locations)
            results.append([await first, second])
        return f"pair {req} then {other['spec']}", results
    if roll < 0.37 and req["route"].startswith("/lease"):
        # The lease lapses while the handler runs; a retry comes (unknown, or a takeover) and
        # then the first execution ends (its settlement refused: its generation is gone).
        for s in sides:
            first = asyncio.ensure_future(_send(s, req, hold=0.3))
            await asyncio.sleep(0.1)
            await s.shift(60.0)
            second = await _send(s, req)
            results.append([await first, second])
        return f"lapse {req}", results
    return f"send {req}", [await _send(s, req) for s in sides]


def _differ(what: str, memory: Any, postgres: Any) -> list[str]:
    if memory == postgres:
        return []
    return [f"{what}:\n  memory   {memory}\n  postgres {postgres}"]


async def _run(seed: int, sides: list[Side]) -> list[str]:
    rng = random.Random(seed)
    templates = [
        {"v": i, "status": rng.choice(STATUSES), "kind": rng.choice(KINDS)} for i in range(4)
    ]
    seen: set[RecordKey] = set()
    locations: set[tuple[str, str]] = set()
    divergences: list[str] = []
    for n in range(STEPS):
        what, results = await _step(rng, sides, templates, seen, locations)
        memory, postgres = results

        divergences += _differ(f"seed {seed} step {n} {what}", memory, postgres)
        effects = [dict(s.effects.counts) for s in sides]
        if effects[0] != effects[1]:
            divergences.append(f"seed {seed} step {n} effects: {effects[0]} != {effects[1]}")
            sides[0].effects.counts = Counter(effects[1])
        for key in sorted(seen):
            records = [await _record(s, key) for s in sides]
            divergences += _differ(f"seed {seed} step {n} record {key}", *records)
        listed = [await _listing(s) for s in sides]
        divergences += _differ(f"seed {seed} step {n} listing", *listed)
        if len(divergences) > 5:
            break
    return divergences


def _client(app: Starlette) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://test")


@pytest.mark.parametrize("seed", range(SEEDS))
async def test_memory_and_postgres_answer_alike(
    seed: int, pg_store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    await pool.execute("DELETE FROM idem_requests; DELETE FROM idem_tokens")
    clock = FakeClock()
    memory = MemoryStore(clock=clock)
    sides: list[Side] = []
    for name, store in (("memory", memory), ("postgres", pg_store)):
        effects = Effects()
        client = _client(make_app(store, effects))
        issuer = TokenIssuer(store, secret=SECRET, ttl_seconds=10 * 365 * 24 * 3600.0)
        sides.append(Side(name, store, effects, client, issuer))
    sides[0].clock = clock
    sides[1].pool = pool
    try:
        divergences = await _run(seed, sides)
    finally:
        for side in sides:
            await side.client.aclose()
    assert not divergences, "\n".join(divergences)

"""The middleware behind hypercorn on 127.0.0.1 with the real store, over HTTP/2 (many streams on
one connection, spoken with the `h2` library: tests/apps/h2client.py) and HTTP/1.1. Skipped
where hypercorn or h2 is not installed (neither is a dependency).

- One connection, many streams with the same key, in both modes: one effect, the rest replays.
- A stream reset (RST_STREAM) while its handler runs: transactional, the handler is cancelled
  once the client watch sees it and rolls back, and the retry on a new stream runs once; lease
  mode, the handler runs on and settles, and the retry replays it. Nothing is left held.
- The connection dropped with streams in flight: the same, per stream.
- hypercorn's graceful shutdown: requests that finish within `graceful_timeout` are answered;
  lease-mode ones cut short past it are left `unknown`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest

from idem_middleware import Mode, Policy, PostgresStore, store_lifespan
from tests.apps import (
    BOUND,
    Step,
    build_app,
    build_lease_app,
    count,
    downstream_rows,
    idle_in_transaction,
    records,
    reset_downstream,
)
from tests.apps.servers import connection, read_response

pytest.importorskip("hypercorn")
pytest.importorskip("h2")

from hypercorn.asyncio import serve
from hypercorn.config import Config

from tests.apps.h2client import Answer, H2Client

pytestmark = pytest.mark.asyncio

HEADERS = {"authorization": "Bearer demo-a", "content-type": "application/json"}
CREDIT = ("/accounts/a1/credits", b'{"amount": 5}')
PAYOUT = ("/payouts", b'{"account": "a", "amount": 5}')
LEASE = Policy(mode=Mode.LEASE, lease_seconds=10.0, wait_seconds=10.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.asynccontextmanager
async def hypercorn_serving(app: Any, graceful: float = 3.0) -> AsyncIterator[tuple[int, Any]]:
    """`app` served by hypercorn in this loop; its port, and the event that shuts it down."""
    config = Config()
    port = _free_port()
    config.bind = [f"127.0.0.1:{port}"]
    config.loglevel = "WARNING"
    config.graceful_timeout = graceful
    stop = asyncio.Event()
    server = asyncio.ensure_future(serve(app, config, shutdown_trigger=stop.wait))
    for _ in range(500):
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            break
        await asyncio.sleep(0.01)
    try:
        yield port, stop
    finally:
        stop.set()
        await asyncio.wait_for(server, BOUND)


def _app(mode: str, store: Any, pool: Any, gate: asyncio.Event | None) -> Any:
    if mode == "transactional":
        app = build_app(store, default_policy=Policy(wait_seconds=10.0))
        app.state.probe.gate = gate
        return app
    app = build_lease_app(store, pool, LEASE)
    app.state.probe.steps = [Step(gate=gate, fence="after") for _ in range(20)]
    return app


def _request(mode: str) -> tuple[str, bytes]:
    return CREDIT if mode == "transactional" else PAYOUT


async def _effects(mode: str, pool: Any) -> int:
    # Both handlers write one ledger row (lease mode's on its fenced connection).
    return await count(pool, "test_ledger")


@pytest.mark.parametrize("mode", ["transactional", "lease"])
async def test_many_streams_one_key_on_one_connection_make_one_effect(
    pg_store: Any, pool: Any, mode: str
) -> None:
    await reset_downstream(pool)
    gate = asyncio.Event()
    app = _app(mode, pg_store, pool, gate)
    path, body = _request(mode)
    async with hypercorn_serving(app) as (port, _):
        client = await H2Client.connect(port)
        try:
            streams = [
                client.request(path, {**HEADERS, "idempotency-key": "storm"}, body)
                for _ in range(40)
            ]
            await asyncio.wait_for(app.state.probe.entered.wait(), BOUND)
            gate.set()
            answers = [await client.answer(s, BOUND) for s in streams]
        finally:
            await client.close()
    assert [a.status for a in answers] == [201] * 40
    originals = [a for a in answers if b"idempotent-replayed" not in a.headers]
    assert len(originals) == 1
    assert {a.body for a in answers} == {originals[0].body}
    assert (app.state.probe.calls, await _effects(mode, pool)) == (1, 1)


async def _until(predicate: Any, what: str) -> None:
    for _ in range(int(BOUND / 0.02)):
        if await predicate():
            return
        await asyncio.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


@pytest.mark.parametrize("mode", ["transactional", "lease"])
async def test_a_stream_reset_mid_handler_leaves_nothing_held_and_the_retry_settles_once(
    pg_store: Any, pool: Any, mode: str
) -> None:
    await reset_downstream(pool)
    gate = asyncio.Event()
    app = _app(mode, pg_store, pool, gate)
    path, body = _request(mode)
    async with hypercorn_serving(app) as (port, _):
        client = await H2Client.connect(port)
        try:
            first = client.request(path, {**HEADERS, "idempotency-key": "reset"}, body)
            await asyncio.wait_for(app.state.probe.entered.wait(), BOUND)
            client.reset(first)
            if mode == "transactional":
                # The client watch sees the reset and cancels the handler: its claim rolls back.
                async def released() -> bool:
                    return await idle_in_transaction(pool) == 0

                await _until(released, "the claim's rollback")
                assert await records(pool) == []
            retry = client.request(path, {**HEADERS, "idempotency-key": "reset"}, body)
            gate.set()
            answer: Answer = await client.answer(retry, BOUND)
        finally:
            await client.close()
    assert answer.status == 201
    if mode == "transactional":
        # The retry ran (the first run's writes rolled back with its claim).
        assert b"idempotent-replayed" not in answer.headers
        assert app.state.probe.calls == 2
    else:
        # The first run went on, settled; the retry waited for it and replays it.
        assert answer.headers[b"idempotent-replayed"] == b"true"
        assert (app.state.probe.calls, await downstream_rows(pool)) == (1, 1)
    assert await _effects(mode, pool) == 1
    assert [r["state"] for r in await records(pool)] == ["succeeded"]
    assert await idle_in_transaction(pool) == 0


@pytest.mark.parametrize("mode", ["transactional", "lease"])
async def test_a_connection_dropped_with_streams_in_flight_then_retried(
    pg_store: Any, pool: Any, mode: str
) -> None:
    await reset_downstream(pool)
    gate = asyncio.Event()
    app = _app(mode, pg_store, pool, gate)
    path, body = _request(mode)
    keys = [f"drop-{i % 3}" for i in range(9)]  # 3 originals, 6 duplicates

    def path_of(key: str) -> str:  # (transactional credits of one account would queue)
        return path.replace("a1", key)

    async with hypercorn_serving(app) as (port, _):
        client = await H2Client.connect(port)
        for key in keys:
            client.request(path_of(key), {**HEADERS, "idempotency-key": key}, body)

        async def three_running() -> bool:
            return app.state.probe.calls == 3 and await idle_in_transaction(pool) == (
                3 if mode == "transactional" else 0
            )

        await _until(three_running, "the three originals")
        await client.close()
        if mode == "transactional":

            async def released() -> bool:
                return await idle_in_transaction(pool) == 0

            await _until(released, "the claims' rollback")
        gate.set()
        again = await H2Client.connect(port)
        try:
            retries = [
                again.request(path_of(key), {**HEADERS, "idempotency-key": key}, body)
                for key in sorted(set(keys))
            ]
            answers = [await again.answer(s, BOUND) for s in retries]
        finally:
            await again.close()
    assert [a.status for a in answers] == [201] * 3
    replayed = [a.headers.get(b"idempotent-replayed") for a in answers]
    # Transactional: the dropped runs rolled back, the retries ran. Lease: the runs went on.
    assert replayed == ([None] * 3 if mode == "transactional" else [b"true"] * 3)
    assert app.state.probe.calls == (6 if mode == "transactional" else 3)
    assert await _effects(mode, pool) == 3
    assert [r["state"] for r in await records(pool)] == ["succeeded"] * 3


def _http1(key: str, path: str, body: bytes) -> bytes:
    head = [
        f"POST {path} HTTP/1.1",
        "host: test",
        f"idempotency-key: {key}",
        *(f"{name}: {value}" for name, value in HEADERS.items()),
        f"content-length: {len(body)}",
    ]
    return "\r\n".join(head).encode() + b"\r\n\r\n" + body


_WAITS_FOR_EVERY_CONNECTION = pytest.mark.skipif(
    sys.version_info >= (3, 12),
    reason="hypercorn on Python 3.12+ waits for every open connection past its graceful "
    "timeout (Server.wait_closed: pgjones/hypercorn#308), so there is no past",
)


@pytest.mark.parametrize(
    "past_the_timeout",
    [False, pytest.param(True, marks=_WAITS_FOR_EVERY_CONNECTION)],
    ids=["within", "past"],
)
async def test_graceful_shutdown_over_http1(db_dsn: str, pool: Any, past_the_timeout: bool) -> None:
    """Within `graceful_timeout`, the lease requests in flight and their waiting duplicates get
    their answers; past it, hypercorn cancels them, then runs the lifespan's shutdown (the
    store's close): the records are `unknown`, not `pending`. The cancelled requests, originals
    and waiting duplicates alike, are answered `503 request-cancelled` (they got hypercorn's
    plain 500 before)."""
    await reset_downstream(pool)
    store = PostgresStore(dsn=db_dsn, min_size=1, max_size=5)
    gate = asyncio.Event()
    app = _app("lease", store, pool, gate)
    app.router.lifespan_context = store_lifespan(store)
    path, body = PAYOUT

    async def pay(port: int, key: str) -> tuple[int, bytes | None]:
        async with connection(port) as (reader, writer):
            writer.write(_http1(key, path, body))
            status, headers, _ = await asyncio.wait_for(read_response(reader), BOUND)
            return status, headers.get(b"retry-after")

    async with hypercorn_serving(app, graceful=1.0) as (port, stop):
        answers = [asyncio.ensure_future(pay(port, f"g{i % 2}")) for i in range(4)]

        async def both_running() -> bool:
            return app.state.probe.calls == 2

        await _until(both_running, "the two originals")
        stop.set()  # what SIGTERM does
        if not past_the_timeout:
            gate.set()
        statuses = await asyncio.wait_for(asyncio.gather(*answers), BOUND)
    assert statuses == ([(503, b"1")] * 4 if past_the_timeout else [(201, None)] * 4)
    states = [r["state"] for r in await records(pool)]
    assert states == (["unknown"] * 2 if past_the_timeout else ["succeeded"] * 2)
    assert app.state.probe.calls == 2
    assert not store.is_open

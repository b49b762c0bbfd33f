"""A soak: one uvicorn process on 127.0.0.1 (tests/apps/soak.py, a PostgresStore of its own)
serves a few thousand mixed requests in both modes while clients misbehave, twice; once the load
stops, the process and the database settle back to their baseline.

The load, per round and route (transactional `/t`, lease `/l`): fresh keys and their replays,
pipelined; a storm of concurrent duplicates on one key; a body that reuses a key; a handler that
raises; clients that leave while their slow handler runs or their duplicate waits, or after
pipelining (the last body cut short); a client that never reads a large response; an oversized
body; the status resource polled; two tenants, each under a connection cap. In lease mode,
claims left by a "crashed" process (the test's own store) whose leases lapse, taken over by
their retries.
A client retries `409 request-in-flight` and `429 tenant-busy`, a bounded number of times.

Then, asserted: no session idle in transaction, no advisory lock, no lock waited for, the
store's connections the pool's; no transactional record pending, no lease pending past its
lease; the process's tasks, idle connections, waiters, tenant slots and timers back to their
baseline; its live objects and RSS after the second soak within a margin of the first's; every
2xx's key written once in the ledger, by the execution whose answer every replay repeats; the
server logged nothing but the handlers' own errors. About 20 s: it runs in the default suite.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from idem_middleware import PostgresStore, RecordKey
from idem_middleware.fingerprint import compute_fingerprint
from idem_middleware.store import Claimed
from tests.apps.clients import TOKENS
from tests.apps.servers import connection, read_response
from tests.apps.soak import APPLICATION, LEDGER, MAX_BODY
from tests.integration.test_worker_servers import BOUND, Server, until

pytestmark = pytest.mark.asyncio

ROOT = Path(__file__).resolve().parents[2]
COMMAND = [sys.executable, "-m", "uvicorn", "--factory", "tests.apps.soak:create_app"]
COMMAND += ["--log-level", "warning", "--host", "127.0.0.1", "--port", "{port}", "--http", "h11"]
#: Rounds per soak (each round is about 40 requests per route).
ROUNDS = 24
#: Clients at once.
CLIENTS = 8
#: A client's tries of one request answered 409 request-in-flight or 429 tenant-busy.
TRIES = 40
#: Growth allowed from the first soak's end to the second's: live objects, RSS (bytes).
OBJECTS_MARGIN = 500
BIG = 8_000_000  # over max_response_bytes (streamed, never held) and the sockets' buffers
#: RSS's margin: the allocator keeps or returns a few large answers' memory as it sees fit.
RSS_MARGIN = 3 * BIG

Response = tuple[int, dict[bytes, bytes], bytes]


def post(
    route: str, key: str, body: bytes = b'{"a":1}', *, token: str = "demo-a", query: str = ""
) -> bytes:
    head = [f"POST /{route}{query} HTTP/1.1", "host: t", f"idempotency-key: {key}"]
    head += [f"authorization: Bearer {token}", "content-type: application/json"]
    head += [f"content-length: {len(body)}"]
    return "\r\n".join(head).encode() + b"\r\n\r\n" + body


def get(path: str, token: str = "demo-a") -> bytes:
    return f"GET {path} HTTP/1.1\r\nhost: t\r\nauthorization: Bearer {token}\r\n\r\n".encode()


@dataclass
class Soak:
    server: Server
    db: asyncpg.Pool[Any]
    store: PostgresStore
    clients: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(CLIENTS))
    #: Every 2xx per (tenant, route, key): (status, body, replayed).
    answers: dict[tuple[str, str, str], list[tuple[int, bytes, bool]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    statuses: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    unread: list[asyncio.StreamWriter] = field(default_factory=list)
    requests: int = 0

    def connection(
        self,
    ) -> contextlib.AbstractAsyncContextManager[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
        return connection(self.server.port)

    async def exchange(self, *raw: bytes) -> list[Response]:
        """`raw` pipelined on one connection; their answers."""
        async with self.clients, self.connection() as (reader, writer):
            writer.write(b"".join(raw))
            self.requests += len(raw)
            answers = [await asyncio.wait_for(read_response(reader), BOUND) for _ in raw]
        for status, _, _ in answers:
            self.statuses[status] += 1
        return answers

    def note(self, tenant: str, route: str, key: str, answer: Response) -> None:
        status, headers, body = answer
        if 200 <= status < 300:
            replayed = headers.get(b"idempotent-replayed") == b"true"
            self.answers[(tenant, route, key)].append((status, body, replayed))

    async def send(self, route: str, key: str, body: bytes = b'{"a":1}', **kw: str) -> Response:
        """One request, retried while it is answered 409 request-in-flight or 429 tenant-busy."""
        tenant = TOKENS[kw.get("token", "demo-a")]
        for attempt in range(TRIES):
            (answer,) = await self.exchange(post(route, key, body, **kw))
            if not _busy(answer):
                self.note(tenant, route, key, answer)
                return answer
            await asyncio.sleep(0.02 * min(attempt + 1, 10))  # (a short backoff)
        pytest.fail(f"{route}/{key}: still busy after {TRIES} tries")

    async def leave_mid_request(self, route: str, key: str) -> None:
        """A client that sends a slow request and closes its socket while the handler runs."""
        async with self.clients, self.connection() as (_, writer):
            writer.write(post(route, key, query="?sleep=1.3"))
            await writer.drain()
            self.requests += 1
            await asyncio.sleep(0.05)

    async def leave(self, *raw: bytes) -> None:
        """A client that sends `raw` (pipelined; the last one perhaps cut short) and closes its
        socket before any answer."""
        async with self.clients, self.connection() as (_, writer):
            writer.write(b"".join(raw))
            await writer.drain()
            self.requests += len(raw)
            await asyncio.sleep(0.05)

    async def never_read(self, route: str, key: str) -> None:
        """A request for a large answer whose client reads nothing (closed after the round)."""
        _, writer = await asyncio.open_connection("127.0.0.1", self.server.port)
        self.unread.append(writer)
        writer.write(post(route, key, query=f"?size={BIG}"))
        self.requests += 1
        await writer.drain()

    async def close_unread(self) -> None:
        writers, self.unread = self.unread, []
        for writer in writers:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await asyncio.wait_for(writer.wait_closed(), BOUND)

    async def state(self) -> dict[str, Any]:
        (answer,) = await self.exchange(get("/debug/state"))
        assert answer[0] == 200, answer
        result: dict[str, Any] = json.loads(answer[2])
        return result


def _busy(answer: Response) -> bool:
    status, headers, _ = answer
    return status in (409, 429) and b"retry-after" in headers


async def _round(soak: Soak, n: int, route: str) -> None:
    tag = f"{route}{n}"
    # The rounds' requests alternate between the tenants (each with its own connection cap).
    token, other = ("demo-a", "demo-b") if n % 2 else ("demo-b", "demo-a")
    tenant = TOKENS[token]

    async def fresh_and_replays() -> None:
        # A fresh key, its retry and the key with another body, pipelined; another tenant's
        # request with the same key is its own.
        answers = await soak.exchange(
            post(route, f"f-{tag}", token=token),
            post(route, f"f-{tag}", token=token),
            post(route, f"f-{tag}", b'{"a":2}', token=token),
            post(route, f"f-{tag}", token=other),
        )
        tenants = [tenant, tenant, "", TOKENS[other]]
        for answer, whose in zip(answers, tenants, strict=True):
            if whose and not _busy(answer):
                soak.note(whose, route, f"f-{tag}", answer)
        if answers[0][0] == 201:  # (else it was refused busy, and the other body may run)
            assert answers[1][0] == 201 or _busy(answers[1]), answers[1]
            assert answers[2][0] == 422 or _busy(answers[2]), answers[2]
            replay = await soak.send(route, f"f-{tag}", token=token)
            assert replay[0] == 201, replay
            assert replay[1][b"idempotent-replayed"] == b"true", replay

    async def storm() -> None:
        got = await asyncio.gather(
            *(soak.send(route, f"s-{tag}", query="?sleep=0.05", token=token) for _ in range(6))
        )
        assert {status for status, _, _ in got} == {201}, got

    async def raises() -> None:
        first = await soak.send(route, f"r-{tag}", query="?fail=1", token=token)
        assert first[0] == 500, first
        again = await soak.send(route, f"r-{tag}", query="?fail=1", token=token)
        # Transactional: the key was released, the retry runs (and fails) again; lease mode:
        # the outcome is unknown, never run again.
        assert again[0] == (500 if route == "t" else 409), again

    async def oversized() -> None:
        (answer,) = await soak.exchange(
            post(route, f"o-{tag}", b"[" + b"1," * MAX_BODY + b"1]", token=token)
        )
        assert answer[0] == 413, answer

    async def status() -> None:
        path = f"/idempotency/status?operation=POST%20/{route}&key=f-{tag}"
        (answer,) = await soak.exchange(get(path, token))
        assert answer[0] in (200, 404), answer

    async def takeover() -> None:
        fingerprint = compute_fingerprint(
            operation="POST /l",
            path_params={},
            query_string=b"",
            headers=[],
            include_headers=(),
            content_type=b"application/json",
            body=b'{"a":1}',
        )
        claim = await soak.store.claim_lease(
            RecordKey(tenant, "POST /l", f"x-{tag}"),
            fingerprint,
            retention_seconds=600,
            lease_seconds=0.2,
        )
        assert isinstance(claim, Claimed)
        await asyncio.sleep(0.3)
        answer = await soak.send(route, f"x-{tag}", token=token)
        assert answer[0] == 201, answer

    jobs = [fresh_and_replays(), storm(), raises(), oversized(), status()]
    if n % 4 == 0:  # (the second, a duplicate, leaves while it waits)
        jobs += [soak.leave_mid_request(route, f"d-{tag}") for _ in range(2)]
    if n % 4 == 1:  # pipelined, then gone: the second request's body cut short
        pipelined = post(route, f"p-{tag}", query="?sleep=0.2", token=token)
        jobs.append(soak.leave(pipelined, post(route, f"q-{tag}", token=token)[:-3]))
    if n % 6 == 0:
        jobs.append(soak.never_read(route, f"b-{tag}"))
    if route == "l" and n % 3 == 0:
        jobs.append(takeover())
    await asyncio.gather(*jobs)


async def _soak(soak: Soak, first: int) -> None:
    for start in range(first, first + ROUNDS, 4):
        await asyncio.gather(
            *(_round(soak, n, route) for n in range(start, start + 4) for route in ("t", "l"))
        )
        await soak.close_unread()
    # The clients that left: their retries are answered (a lease-mode one, cancelled, may be
    # unknown: never run again).
    retries = [
        (route, f"d-{route}{n}") for n in range(first, first + ROUNDS, 4) for route in ("t", "l")
    ]
    answers = await asyncio.gather(*(soak.send(r, k, query="?sleep=1.3") for r, k in retries))
    for (route, _), answer in zip(retries, answers, strict=True):
        assert answer[0] in ((201,) if route == "t" else (201, 409)), answer


async def _settled(soak: Soak, baseline: dict[str, Any]) -> dict[str, Any]:
    """The process's state once it is back to its baseline (bounded wait; the last state read
    is returned, and asserted on by the caller)."""
    last: dict[str, Any] = {}

    async def back() -> bool:
        nonlocal last
        last = await soak.state()
        return (
            last["tasks"] <= baseline["tasks"]
            and last["pool_idle"] == last["pool_size"]
            and last["waiters"] == 0
            and not last["tenant_slots"]
            and await _transactions(soak.db) == 0
        )

    for _ in range(int(BOUND / 0.1)):
        if await back():
            break
        await asyncio.sleep(0.1)
    return last


async def _transactions(db: asyncpg.Pool[Any]) -> int:
    n: int = await db.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND pid <> pg_backend_pid() AND state LIKE 'idle in transaction%'"
    )
    return n


async def _database_at_rest(soak: Soak, pool_size: int) -> None:
    db = soak.db
    assert await _transactions(db) == 0
    assert await db.fetchval("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'") == 0
    assert await db.fetchval("SELECT count(*) FROM pg_locks WHERE NOT granted") == 0
    names = await db.fetch(
        "SELECT application_name, count(*) AS n FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name LIKE $1"
        " GROUP BY application_name",
        APPLICATION + "%",
    )
    by_name = {row["application_name"]: row["n"] for row in names}
    assert by_name.pop(APPLICATION) == pool_size, by_name
    assert set(by_name) <= {APPLICATION + ".listen", APPLICATION + ".renew"}, by_name
    assert all(n == 1 for n in by_name.values()), by_name
    pending = await db.fetch(
        "SELECT idem_key, mode, lease_expires_at < now() AS lapsed FROM idem_requests"
        " WHERE state = 'pending'"
    )
    assert [r for r in pending if r["mode"] == "transactional" or r["lapsed"]] == []


async def _each_effect_once(soak: Soak) -> None:
    rows = await soak.db.fetch("SELECT tenant, route, k, run FROM soak_ledger")
    runs: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for row in rows:
        runs[(row["tenant"], row["route"], row["k"])].append(row["run"])
    twice = {k: v for k, v in runs.items() if len(v) > 1}
    assert twice == {}, f"effects run more than once: {twice}"
    for key, answers in soak.answers.items():
        originals = [a for a in answers if not a[2]]
        assert len(originals) <= 1, (key, answers)
        assert {(status, body) for status, body, _ in answers} == {answers[0][:2]}, (key, answers)
        assert len(runs.get(key, [])) == 1, (key, answers)
        body = answers[0][1]
        if body.startswith(b"{"):
            assert json.loads(body)["run"] == runs[key][0], (key, answers)
    # A failed handler's transaction wrote nothing.
    failed = [k for k in runs if k[1] == "t" and k[2].startswith("r-")]
    assert failed == []


@pytest.fixture
async def soak(db_dsn: str, tmp_path: Path) -> AsyncIterator[Soak]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SOAK_DSN": db_dsn}
    db = await asyncpg.create_pool(db_dsn, min_size=1, max_size=2)
    server = Server(COMMAND, env, tmp_path / "server.log")
    try:
        await db.execute(LEDGER)
        await db.execute("TRUNCATE idem_requests, soak_ledger")
        server.start()
        async with PostgresStore(dsn=db_dsn, min_size=1, max_size=2, listen=False) as store:
            soak = Soak(server, db, store)

            async def serving() -> bool:
                try:
                    async with soak.connection() as (reader, writer):
                        writer.write(get("/ping"))
                        await asyncio.wait_for(read_response(reader), BOUND)
                except OSError:
                    assert server.proc is not None
                    assert server.proc.poll() is None, server.tail()
                    return False
                return True

            await until(serving, "the server")
            try:
                yield soak
            finally:
                await soak.close_unread()
    finally:
        server.stop()
        await db.close()
    # The server logged the handlers' own errors, and nothing else.
    log = server.log.read_text(errors="replace")
    for error in log.split("Traceback (most recent call last):")[1:]:
        assert "RuntimeError: the handler failed after its write" in error, error


async def test_a_soak_settles_back_to_its_baseline(soak: Soak) -> None:
    assert (await soak.send("l", "warm"))[0] == 201
    baseline = await soak.state()

    await _soak(soak, 0)
    first = await _settled(soak, baseline)
    await _soak(soak, ROUNDS)
    second = await _settled(soak, baseline)

    for after in (first, second):
        assert after["tasks"] <= baseline["tasks"], (baseline, after)
        assert after["pool_idle"] == after["pool_size"], after
        assert (after["waiters"], after["waiting_keys"], after["tenant_slots"]) == (0, 0, {})
        assert (after["listener_waiters"], after["listener_pending"]) == (0, 0), after
        assert after["timer_items"] == 0, after
    assert second["gc_objects"] <= first["gc_objects"] + OBJECTS_MARGIN, (first, second)
    assert second["rss"] <= first["rss"] + RSS_MARGIN, (first, second)
    await _database_at_rest(soak, second["pool_size"])
    await _each_effect_once(soak)
    assert soak.requests > 2000, soak.requests
    print(f"soak: {soak.requests} requests, statuses {dict(soak.statuses)}; {first} -> {second}")

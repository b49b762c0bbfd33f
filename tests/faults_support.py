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
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
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
    try:
        r = await client.post(case.path, json=case.body, headers=case.headers)
    except httpx.TransportError as exc:
        case.trouble[type(exc).__name__] += 1
        return None
    answer = Answer(r.status_code, r.content, r.headers.get("idempotent-replayed") == "true")
    if definitive(r.status_code):
        case.answers.append(answer)
    else:
        case.trouble[f"status {r.status_code}"] += 1
    return answer


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
    for _ in range(max_attempts):
        answer = await send_once(client, case)
        if answer is not None and definitive(answer.status):
            return answer
        await asyncio.sleep(pause * rng.uniform(0.5, 1.5))
        pause = min(pause * 1.5, 0.5)
    return None


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
        "SELECT state, response_status, response_body, note, epoch FROM idem_requests "
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
        consistent = account is not None and account["balance"] == FUND - case.amount * len(rows)
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
        result.findings.append(f"{where}: left {state}")
    elif expect_settled and not case.ok_answers:
        result.stuck_keys += 1
        statuses = [a.status for a in case.answers]
        result.findings.append(f"{where}: no 2xx after {case.attempts} attempts {statuses}")
    for answer in case.ok_answers:
        problem = _lost(case, answer, rec, ids, transfers)
        if problem:
            result.lost_outcomes += 1
            result.findings.append(f"{where}: a {answer.status} the client got: {problem}")


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

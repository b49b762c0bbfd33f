"""The fragments of docs/*.md that are not whole apps, run as a newcomer pastes them, on a real
PostgreSQL: docs/sqlalchemy.md's three, docs/tokens-and-outbox.md's token route and outbox
(`add`, `Publisher`, `consume_once`), docs/jobs.md's job, docs/lease-mode.md's payout and its
reconciler, docs/observability.md's observers and log filter. (The whole apps of README.md,
docs/fastapi.md and docs/starlette.md run in test_readme_examples.py, docs/testing.md's in
test_pytest_plugin.py, docs/configuration-knobs.md's in tests/unit/test_doc_examples.py.)

Each block is taken from its page and run as it is written, with only the blanks filled that a
reader fills (a model, the app, the store, the `...` of a body): `fill` names each blank and
fails when the page no longer has it. What the fragment leaves out (the app's authentication)
is added the way README.md's app does it."""

from __future__ import annotations

import ast
import asyncio
import hashlib
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import Depends, FastAPI
from prometheus_client import CollectorRegistry
from pydantic import BaseModel
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlmodel import Field, SQLModel
from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, SimpleUser
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, PostgresStore
from idem_middleware.fastapi import Idempotency, install

ROOT = Path(__file__).resolve().parents[2]
TENANT = "tenant-a"


def fragment(page: str, heading: str) -> str:
    """The first Python block after the heading `heading` (of any level) of `page`."""
    text = (ROOT / "docs" / page).read_text()
    start = re.search(rf"^#+ {re.escape(heading)}\n", text, re.MULTILINE)
    assert start, f"no heading {heading!r} in docs/{page}"
    block = re.compile(r"```python\n(.*?)```", re.DOTALL).search(text, start.end())
    assert block, f"no python block under {heading!r} in docs/{page}"
    return block.group(1)


def fill(block: str, blanks: dict[str, str]) -> str:
    """`block` with each blank replaced: every blank must still be on the page."""
    for blank, value in blanks.items():
        assert blank in block, f"the fragment no longer has {blank!r}:\n{block}"
        block = block.replace(blank, value)
    return block


async def run(block: str, namespace: dict[str, Any], name: str = "fragment") -> Any:
    """Run `block` in `namespace` as the asyncio REPL would: top-level `await` allowed."""
    code = compile(block, name, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    result = eval(code, namespace)
    if asyncio.iscoroutine(result):
        return await result
    return result


def paragraphs(block: str, *starts: str) -> list[str]:
    """The blank-line-separated parts of a block, which must start as `starts` say."""
    parts = [part.strip("\n") for part in block.split("\n\n") if part.strip()]
    assert [part[: len(start)] for part, start in zip(parts, starts, strict=True)] == list(starts)
    return parts


class Everyone(AuthenticationBackend):
    """Every request is TENANT's (README.md's app authenticates the same way)."""

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, SimpleUser]:
        return AuthCredentials(["authenticated"]), SimpleUser(TENANT)


def client(app: Any) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://t")


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "doc_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    item: Mapped[str]


class OrderIn(BaseModel):
    item: str


class OrderOut(BaseModel):
    id: int


class DocHero(SQLModel, table=True):
    """The page's `Hero` (passed to its fragment under that name). Not named Hero here: SQLModel's
    classes share one registry, and a second `Hero` (tests/sqlmodel_models.py, imported when the
    whole suite is collected) makes its relationships' "Hero" ambiguous, a 500 in both files."""

    __tablename__ = "doc_heroes"
    id: int | None = Field(default=None, primary_key=True)
    name: str


@pytest.fixture
async def store(db_dsn: str, pool: asyncpg.Pool[Any]) -> AsyncIterator[PostgresStore]:
    """A store on a DSN, as the pages make it, the library's tables emptied (by `pool`)."""
    await pool.execute(
        "CREATE TABLE IF NOT EXISTS doc_orders (id serial PRIMARY KEY, item text NOT NULL)"
    )
    await pool.execute("TRUNCATE doc_orders")
    async with PostgresStore(dsn=db_dsn) as opened:
        yield opened


async def test_sqlalchemy_fastapi_fragment_commits_the_row_with_the_record(
    store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    block = fragment("sqlalchemy.md", "FastAPI")
    names = {"OrderIn": OrderIn, "OrderOut": OrderOut, "Order": Order, "store": store}
    await run(block, names)
    app = names["app"]
    app.add_middleware(AuthenticationMiddleware, backend=Everyone())
    async with client(app) as http:
        first = await http.post("/orders", json={"item": "book"}, headers={"idempotency-key": "s"})
        again = await http.post("/orders", json={"item": "book"}, headers={"idempotency-key": "s"})
    assert first.status_code == 200, first.text
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json()
    rows = await pool.fetch("SELECT id, item FROM doc_orders")
    assert [tuple(row) for row in rows] == [(first.json()["id"], "book")]


async def test_sqlalchemy_starlette_fragment_writes_on_exit_of_the_session(
    store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    """`session.add(...)` alone, no flush: leaving `open_claim_session` writes it, in the
    claim's transaction."""
    block = fill(
        fragment("sqlalchemy.md", "Starlette (and anything running under a claim)"),
        {"Order(...)": "Order(item='pen')", "JSONResponse({...})": "JSONResponse({'ok': True})"},
    )
    names: dict[str, Any] = {"Order": Order, "JSONResponse": JSONResponse}
    await run(block, names)
    routes = [Route("/orders", names["create_order"], methods=["POST"])]
    app = Starlette(routes=routes)
    app.add_middleware(IdempotencyMiddleware, store=store)
    app.add_middleware(AuthenticationMiddleware, backend=Everyone())
    async with client(app) as http:
        first = await http.post("/orders", json={}, headers={"idempotency-key": "st"})
        again = await http.post("/orders", json={}, headers={"idempotency-key": "st"})
    assert first.status_code == 200, first.text
    assert again.headers["idempotent-replayed"] == "true"
    assert [row["item"] for row in await pool.fetch("SELECT item FROM doc_orders")] == ["pen"]


async def test_sqlmodel_fragment_commits_the_hero_with_the_record(
    store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    await pool.execute("CREATE TABLE IF NOT EXISTS doc_heroes (id serial PRIMARY KEY, name text)")
    await pool.execute("TRUNCATE doc_heroes")
    app = FastAPI()
    # As written: the handler adds the hero and ends (`...`); the session's end writes it.
    names: dict[str, Any] = {"app": app, "Hero": DocHero, "Depends": Depends}
    await run(fragment("sqlalchemy.md", "SQLModel, other session classes, engine options"), names)
    install(app, store=store)
    app.add_middleware(AuthenticationMiddleware, backend=Everyone())
    async with client(app) as http:
        first = await http.post("/heroes", json={"name": "Rusty"}, headers={"idempotency-key": "h"})
        again = await http.post("/heroes", json={"name": "Rusty"}, headers={"idempotency-key": "h"})
    assert first.status_code == 200, first.text
    assert again.headers["idempotent-replayed"] == "true"
    assert [row["name"] for row in await pool.fetch("SELECT name FROM doc_heroes")] == ["Rusty"]


async def test_token_fragment_issues_a_token_the_route_takes_once(
    store: PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IDEM_TOKEN_SECRET", "s" * 32)
    calls: list[str] = []
    block = fill(
        fragment("tokens-and-outbox.md", "One-time tokens"),
        {"-> dict[str, int]: ...": "-> dict[str, int]:\n    calls.append(order.item)\n"
         "    return {'orders': len(calls)}"},
    )  # fmt: skip
    app = FastAPI()
    await run(block, {"app": app, "store": store, "OrderIn": OrderIn, "calls": calls})
    install(app, store=store)
    app.add_middleware(AuthenticationMiddleware, backend=Everyone())
    async with client(app) as http:
        issued = await http.post("/idempotency/tokens", json={"operation": "POST /orders"})
        assert issued.status_code == 201, issued.text
        key = {"idempotency-key": issued.json()["token"]}
        first = await http.post("/orders", json={"item": "a"}, headers=key)
        again = await http.post("/orders", json={"item": "a"}, headers=key)
        plain = await http.post("/orders", json={"item": "a"}, headers={"idempotency-key": "k"})
    assert first.status_code == 201, first.text
    assert again.headers["idempotent-replayed"] == "true"
    assert plain.status_code == 400
    assert plain.json()["type"].endswith(":token-invalid")
    assert calls == ["a"]


async def test_outbox_fragment_adds_publishes_and_consumes_once(
    store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    """The block's three parts, each where its comment puts it: `add` in a handler on the claim's
    connection, a `Publisher` run until stopped, `consume_once` in the receiver's transaction."""
    imports, handler_part, publisher_part, consumer_part = paragraphs(
        fragment("tokens-and-outbox.md", "The transactional outbox"),
        "from idem_middleware.outbox import",
        "# In the handler, on the claim's connection",
        "# A publisher",
        "# A consumer, in its own transaction",
    )
    handler_part = fill(handler_part, {'{"credit_id": ...}': '{"credit_id": credit_id}'})
    publisher_part = fill(publisher_part, {"httpx.AsyncClient()": "receiver"})
    consumer_part = fill(
        consumer_part, {"...  # apply the event": "applied.append(event_id)  # apply the event"}
    )
    names: dict[str, Any] = {}
    await run(imports, names)

    app = FastAPI()

    @app.post("/credits", status_code=201)
    async def create_credit(idem: Idempotency) -> dict[str, int]:
        credit_id = 7
        await run(handler_part, {**names, "conn": idem.connection, "credit_id": credit_id})
        return {"credit_id": credit_id}

    install(app, store=store)
    app.add_middleware(AuthenticationMiddleware, backend=Everyone())

    applied: list[str] = []
    stop_event = asyncio.Event()

    async def hook(request: Request) -> JSONResponse:
        event_id = (await request.json())["event_id"]
        try:
            for _ in range(2):  # a redelivery: only the first gets applied
                async with pool.acquire() as conn:
                    namespace = {**names, "conn": conn, "event_id": event_id, "applied": applied}
                    await run(consumer_part, namespace)
        finally:
            stop_event.set()  # the publisher stops after this send, whatever its outcome
        return JSONResponse({})

    receiving = Starlette(routes=[Route("/hook", hook, methods=["POST"])])
    async with client(app) as http:
        created = await http.post("/credits", json={}, headers={"idempotency-key": "credit"})
        again = await http.post("/credits", json={}, headers={"idempotency-key": "credit"})
    assert created.status_code == 201, created.text
    assert again.headers["idempotent-replayed"] == "true"
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=receiving)) as receiver:
        namespace = {**names, "httpx": httpx, "store": store, "receiver": receiver}
        namespace |= {"url": "http://receiver/hook", "stop_event": stop_event}
        await asyncio.wait_for(run(publisher_part, namespace), timeout=60)  # bounds a hang
    assert applied == ["credit:7"]
    sent = await pool.fetch("SELECT event_id, sent_at IS NOT NULL AS sent FROM idem_outbox")
    assert [tuple(row) for row in sent] == [("credit:7", True)]
    await pool.execute("TRUNCATE idem_inbox")


async def test_job_fragment_runs_once_and_a_redelivery_gets_the_result(
    store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    await pool.execute("CREATE TABLE IF NOT EXISTS sent_invoices (id text PRIMARY KEY)")
    await pool.execute("TRUNCATE sent_invoices")
    block = fill(
        fragment("jobs.md", "Idempotent jobs and queue consumers"),
        {"INSERT INTO sent_invoices ...": "INSERT INTO sent_invoices (id) VALUES ($1)"},
    )
    message = type("Message", (), {"id": "inv-1"})()
    names: dict[str, Any] = {"store": store, "message": message}
    await run(block, names)  # its last line: the first delivery
    redelivered = await names["send_invoice"](account="acme", invoice_id=message.id)
    assert redelivered == {"sent": "inv-1"}
    assert [row["id"] for row in await pool.fetch("SELECT id FROM sent_invoices")] == ["inv-1"]
    records = await pool.fetch("SELECT tenant, operation, state FROM idem_requests")
    assert [tuple(row) for row in records] == [("acme", "invoices.send", "succeeded")]


class PayoutIn(BaseModel):
    amount: int


class Bank:
    """The bank the lease-mode example calls: transfers by the caller's `Idempotency-Key`; a
    failure set for the next transfer happens before it moves the money or after (its answer
    lost)."""

    def __init__(self) -> None:
        self.transfers: dict[str, dict[str, Any]] = {}
        self.fail: str | None = None  # "before" or "after"

    def __call__(self, request: httpx.Request) -> httpx.Response:
        key = request.url.path.removeprefix("/transfers").strip("/")
        if request.method == "GET":
            found = self.transfers.get(key)
            return httpx.Response(200, json=found) if found else httpx.Response(404)
        fail, self.fail = self.fail, None
        if fail == "before":
            raise httpx.ConnectError("the bank is unreachable", request=request)
        key = request.headers["idempotency-key"]
        amount = httpx.Response(200, content=request.content).json()["amount"]
        transfer = {"transfer_id": f"tr-{len(self.transfers) + 1}", "amount": amount}
        self.transfers.setdefault(key, transfer)
        if fail == "after":
            raise httpx.ReadError("the bank's answer was lost", request=request)
        return httpx.Response(201, json=self.transfers[key])


@pytest.mark.parametrize("fail", [None, "after", "before"])
async def test_lease_fragment_pays_once_and_its_reconciler_settles_a_crash(
    fail: str | None, store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    """The payout as written; the bank's answer lost after it moved the money (the reconciler
    finds the transfer: `Happened`) or the bank never reached (`NotHappened`: run again with the
    same downstream key). Either way one transfer, one debit, and a replay."""
    await pool.execute("CREATE TABLE IF NOT EXISTS accounts (id int PRIMARY KEY, balance int)")
    await pool.execute("TRUNCATE accounts; INSERT INTO accounts VALUES (1, 100)")
    block = fill(
        fragment("lease-mode.md", "Lease mode: effects outside the database"),
        {"balance - $1 ...": "balance - $1 WHERE id = 1", "json=...": "json=body.model_dump()"},
    )
    bank = Bank()
    app = FastAPI()
    transport = httpx.MockTransport(bank)
    async with httpx.AsyncClient(transport=transport, base_url="http://bank.test") as bank_http:
        await run(block, {"app": app, "bank": bank_http, "PayoutIn": PayoutIn})
        install(app, store=store)
        app.add_middleware(AuthenticationMiddleware, backend=Everyone())
        headers = {"idempotency-key": "payout-1"}
        async with client(app) as http:
            bank.fail = fail
            first = await http.post("/payouts", json={"amount": 5}, headers=headers)
            retried = await http.post("/payouts", json={"amount": 5}, headers=headers)
            again = await http.post("/payouts", json={"amount": 5}, headers=headers)
    assert first.status_code == (201 if fail is None else 500), first.text
    assert retried.status_code == 201, retried.text
    assert retried.headers.get("idempotent-replayed") == ("true" if fail != "before" else None)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == retried.json() == {"transfer_id": "tr-1"}
    assert len(bank.transfers) == 1
    assert await pool.fetchval("SELECT balance FROM accounts WHERE id = 1") == 95


async def test_observability_fragments_count_trace_log_and_hash_the_tenant(
    store: PostgresStore, caplog: pytest.LogCaptureFixture
) -> None:
    """The observers as installed on the page (the Prometheus one on a registry of the test's own:
    the page's `PrometheusObserver()` registers in the process's, once), then its log filter."""
    install_block = fill(
        fragment("observability.md", "Metrics, traces and logs"),
        {"PrometheusObserver()\n": "PrometheusObserver(registry=registry)\n"},
    )
    text = (ROOT / "docs" / "observability.md").read_text()
    filter_block = re.findall(r"```python\n(.*?)```", text, re.DOTALL)[1]
    assert "class HashedTenant(logging.Filter)" in filter_block
    app = FastAPI()

    @app.post("/things")
    async def things(body: dict[str, int]) -> dict[str, int]:
        return body

    registry = CollectorRegistry()
    await run(install_block, {"app": app, "install": install, "store": store, "registry": registry})
    app.add_middleware(AuthenticationMiddleware, backend=Everyone())
    # (caplog's handler is pytest's for the whole run: the page's filter comes off it after.)
    filters = list(caplog.handler.filters)
    await run(filter_block, {"logging": logging, "hashlib": hashlib, "handler": caplog.handler})
    try:
        with caplog.at_level(logging.INFO, logger="idem_middleware"):
            async with client(app) as http:
                for _ in range(2):
                    await http.post("/things", json={"a": 1}, headers={"idempotency-key": "o"})
    finally:
        caplog.handler.filters[:] = filters
    outcomes = [r.outcome for r in caplog.records if hasattr(r, "outcome")]
    assert outcomes == ["claimed", "succeeded", "replayed"]
    hashed = hashlib.sha256(TENANT.encode()).hexdigest()[:16]
    assert {r.tenant for r in caplog.records if hasattr(r, "tenant")} == {hashed}
    replayed = {"operation": "POST /things", "outcome": "replayed"}
    assert registry.get_sample_value("idem_requests_total", replayed) == 1
    assert registry.get_sample_value("idem_records", {"state": "pending"}) == 0


#: The fragments run above, by page and heading (observability.md's filter is its second block).
RUN_HERE = [
    ("sqlalchemy.md", "FastAPI"),
    ("sqlalchemy.md", "Starlette (and anything running under a claim)"),
    ("sqlalchemy.md", "SQLModel, other session classes, engine options"),
    ("tokens-and-outbox.md", "One-time tokens"),
    ("tokens-and-outbox.md", "The transactional outbox"),
    ("jobs.md", "Idempotent jobs and queue consumers"),
    ("lease-mode.md", "Lease mode: effects outside the database"),
    ("observability.md", "Metrics, traces and logs"),
]
#: Pages whose every block another module runs: the knobs' (tests/unit/test_doc_examples.py)
#: and testing.md's (test_pytest_plugin.py).
RUN_ELSEWHERE = {"configuration-knobs.md", "testing.md"}


def test_every_fragment_of_the_docs_is_run_by_a_test() -> None:
    """A block added to a page, or moved under another heading, is run somewhere or fails here."""
    from tests.integration.test_readme_examples import PAGE_EXAMPLES, example

    run_blocks = {fragment(page, heading) for page, heading in RUN_HERE}
    run_blocks |= {example(heading, page) for page, heading in PAGE_EXAMPLES.values()}
    text = (ROOT / "docs" / "observability.md").read_text()
    run_blocks.add(re.findall(r"```python\n(.*?)```", text, re.DOTALL)[1])
    unrun = [
        f"{page.name}: {block.splitlines()[0]}"
        for page in sorted((ROOT / "docs").glob("*.md"))
        if page.name not in RUN_ELSEWHERE
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.DOTALL)
        if block not in run_blocks
    ]
    assert unrun == []

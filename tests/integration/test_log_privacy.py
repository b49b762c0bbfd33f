"""What a client or a tenant chose never reaches a log line at INFO or above, a metric label or a
span attribute: keys, tokens, bodies, response bodies, the Authorization header, other header
values. Many scenarios on a real PostgresStore, in both modes, with marker strings in every
value; every log record (any level, any logger) is checked: its message, its arguments, its
traceback and its `extra` fields. The tenant is allowed in one documented place only: the
`tenant` field of a record's `extra` (docs/observability.md), and as a span attribute with
`record_tenant=True`. DEBUG may name more (docs/security.md)."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import traceback
from collections.abc import Iterator
from typing import Any

import asyncpg
import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, SimpleUser
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from idem_middleware import IdempotencyMiddleware, Mode, Policy, PostgresStore, cli_commands
from idem_middleware import cli as cli_module
from idem_middleware.context import get_context
from idem_middleware.errors import IdempotencyError, StatementRefused
from idem_middleware.observe import LoggingObserver
from idem_middleware.otel import OpenTelemetryObserver
from idem_middleware.outbox import Publisher, add, webhook_sender
from idem_middleware.prometheus import PrometheusObserver
from idem_middleware.reconcile import ReconcileContext, Reconciliation, StillUnknown
from idem_middleware.reconcile_batch import reconcile_unknown
from idem_middleware.status import status_route
from idem_middleware.store.base import RecordKey
from idem_middleware.store.postgres.convert import translate
from idem_middleware.tokens import TokenIssuer, token_route

KEY = "SECRETKEY-7f3a"
BODY = "SECRETBODY-19c2"
RESP = "SECRETRESP-5be0"
AUTH = "SECRETAUTH-88d1"
HEADER = "SECRETHDR-2a4c"
TENANT = "SECRETTENANT-61e7"
PAYLOAD = "SECRETPAYLOAD-d03b"
#: Never anywhere at INFO or above, in any form (bytea shows as hex in PostgreSQL's DETAIL).
SECRETS = [KEY, BODY, RESP, AUTH, HEADER, PAYLOAD]
SECRETS += [s.encode().hex() for s in SECRETS]

T_PAY, T_BOOM = "/t/pay", "/t/boom"
L_PAY, L_BOOM = "/l/pay", "/l/boom"
OP_L_BOOM = f"POST {L_BOOM}"
STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class Backend(AuthenticationBackend):
    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, SimpleUser] | None:
        if conn.headers.get("authorization") == f"Bearer {AUTH}":
            return AuthCredentials(["authenticated"]), SimpleUser(TENANT)
        return None


class Gate:
    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.hold = False


async def pay(request: Request) -> Response:
    body = await request.body()
    gate: Gate = request.app.state.gate
    if gate.hold:
        gate.entered.set()
        await asyncio.wait_for(gate.release.wait(), 10)
    return JSONResponse({"echo": body.decode(), "secret": RESP}, status_code=201)


async def boom(request: Request) -> Response:
    await request.body()
    ctx = get_context()
    assert ctx is not None
    raise RuntimeError("the handler failed")  # (an app's own message is the app's business)


def build(store: PostgresStore, issuer: TokenIssuer, **options: Any) -> Raised:
    lease = {"mode": Mode.LEASE, "lease_seconds": 5, "wait_seconds": 0.2, "max_body_bytes": 200}
    app = Starlette(
        routes=[
            Route(T_PAY, pay, methods=["POST"]),
            Route(T_BOOM, boom, methods=["POST"]),
            Route(L_PAY, pay, methods=["POST"]),
            Route(L_BOOM, boom, methods=["POST"]),
            Route("/tok", pay, methods=["POST"]),
            status_route(store),
            token_route(issuer),
        ],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=Backend()),
            Middleware(
                IdempotencyMiddleware,
                store=store,
                default_policy=Policy(wait_seconds=0.2, max_body_bytes=200),
                policies={
                    f"POST {L_PAY}": Policy(**lease, accept_while_in_flight=True),  # type: ignore[arg-type]
                    OP_L_BOOM: Policy(**lease),  # type: ignore[arg-type]
                    "POST /tok": Policy(require_token=True, wait_seconds=0.2),
                },
                **options,
            ),
        ],
    )
    app.state.gate = Gate()
    return Raised(app)


class Raised:
    """The app as a server runs it, keeping what it raises as the server would log it (uvicorn:
    "Exception in ASGI application", at ERROR, with the traceback)."""

    def __init__(self, app: Starlette) -> None:
        self.app = app
        self.state = app.state
        self.raised: list[logging.LogRecord] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.app(scope, receive, send)
        except Exception:
            self.raised.append(
                logging.LogRecord("server", logging.ERROR, "", 0, "app", None, sys.exc_info())
            )
            raise


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
        base_url="http://test",
        headers={"authorization": f"Bearer {AUTH}", "x-note": HEADER},
    )


def body(n: int = 0) -> dict[str, Any]:
    return {"note": BODY, "n": n}


# -- what is checked ----------------------------------------------------------------------------


def _texts(record: logging.LogRecord) -> Iterator[tuple[str, str]]:
    yield "message", record.getMessage()
    yield "msg", str(record.msg)
    yield "args", repr(record.args)
    if record.exc_info:
        yield "exc_info", logging.Formatter().formatException(record.exc_info)
        # What an error tracker records beyond the text: each exception's attributes (asyncpg's
        # `detail`, `hint` and `context`, which is not in the text), down the chain.
        error, seen = record.exc_info[1], 0
        while error is not None and seen < 8:
            yield f"attributes of {type(error).__name__}", repr(vars(error))
            error, seen = error.__cause__ or error.__context__, seen + 1
    if record.exc_text:
        yield "exc_text", record.exc_text
    if record.stack_info:
        yield "stack_info", record.stack_info
    for name, value in vars(record).items():
        if name not in STANDARD:
            yield f"extra {name}", repr(value)


def leaks(records: list[logging.LogRecord], extra_secrets: list[str] = ()) -> list[str]:  # type: ignore[assignment]
    """Every place a marker shows in a record at INFO or above."""
    found = []
    for record in records:
        # (the test's HTTP client logs each URL at INFO: the status resource's key with it)
        if record.levelno < logging.INFO or record.name.startswith("httpx"):
            continue
        for where, text in _texts(record):
            for secret in [*SECRETS, *extra_secrets]:
                if secret in text:
                    found.append(f"{record.levelname} {record.name} {where}: {secret} in {text!r}")
            if TENANT in text and where != "extra tenant":
                found.append(f"{record.levelname} {record.name} {where}: tenant in {text!r}")
    return found


@pytest.fixture
def logs() -> Iterator[list[logging.LogRecord]]:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    root = logging.getLogger()
    handler, level = Keep(logging.DEBUG), root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


@pytest.fixture
def observed() -> Iterator[tuple[list[Any], CollectorRegistry, InMemorySpanExporter]]:
    registry = CollectorRegistry()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    observers = [
        PrometheusObserver(registry=registry),
        OpenTelemetryObserver(tracer_provider=provider),
        LoggingObserver(),
    ]
    with provider.get_tracer("test").start_as_current_span("request"):
        yield observers, registry, exporter


def assert_nothing_leaked(
    records: list[logging.LogRecord],
    registry: CollectorRegistry | None = None,
    exporter: InMemorySpanExporter | None = None,
    extra: list[str] = (),  # type: ignore[assignment]
    app: Raised | None = None,
) -> None:
    assert records, "nothing was logged: the capture is not working"
    found = leaks([*records, *(app.raised if app is not None else ())], extra)
    assert found == [], "\n".join(found)
    everything = [*SECRETS, *extra, TENANT]
    if registry is not None:
        for metric in registry.collect():
            for sample in metric.samples:
                for value in sample.labels.values():
                    assert not any(s in value for s in everything), (sample.name, value)
    if exporter is not None:
        spans = exporter.get_finished_spans()
        assert spans
        for span in spans:
            shown = [repr(dict(span.attributes or {})), span.name]
            shown += [f"{e.name} {dict(e.attributes or {})}" for e in span.events]
            for text in shown:
                assert not any(s in text for s in everything), (span.name, text)


# -- the scenarios --------------------------------------------------------------------------------


def test_the_check_sees_a_leak() -> None:
    """The checker itself: a raw key at INFO, a tenant in a message, a body in a traceback."""
    try:
        raise ValueError(BODY)
    except ValueError:
        exc = sys.exc_info()
    made = [
        logging.LogRecord("x", logging.INFO, "", 0, "key %s", (KEY,), None),
        logging.LogRecord("x", logging.WARNING, "", 0, f"for {TENANT}", None, None),
        logging.LogRecord("x", logging.ERROR, "", 0, "failed", None, exc),
        logging.LogRecord("x", logging.DEBUG, "", 0, "key %s", (KEY,), None),
    ]
    made[2].__dict__["key"] = AUTH
    assert [bool(leaks([r])) for r in made] == [True, True, True, False]
    made[2].__dict__["tenant"] = TENANT  # (the one documented place for the tenant)
    made[2].exc_info = None
    assert leaks(made[2:3]) == ["ERROR x extra key: SECRETAUTH-88d1 in \"'SECRETAUTH-88d1'\""]


@pytest.mark.parametrize("mode", ["transactional", "lease"])
async def test_requests_in_every_outcome(
    pg_store: PostgresStore, pool: Any, logs: Any, observed: Any, mode: str
) -> None:
    observers, registry, exporter = observed
    issuer = TokenIssuer(pg_store, secret=b"s" * 32)
    app = build(pg_store, issuer, observers=observers)
    pay_url, boom_url = (T_PAY, T_BOOM) if mode == "transactional" else (L_PAY, L_BOOM)
    k = {"idempotency-key": KEY}
    async with client(app) as c:
        fresh = await c.post(pay_url, json=body(), headers=k)
        assert fresh.status_code == 201, fresh.text
        assert (await c.post(pay_url, json=body(), headers=k)).status_code == 201  # replay
        assert (await c.post(pay_url, json=body(1), headers=k)).status_code == 422
        # Keys that are almost valid, or not at all.
        for bad in (f"{KEY}\x7f", f"{KEY} " + "x" * 300, f'"{KEY}', f"{KEY}\tx"):
            r = await c.post(pay_url, json=body(), headers={"idempotency-key": bad})
            assert r.status_code == 400, (bad, r.text)
        too_big = {"note": BODY * 40}
        r = await c.post(pay_url, json=too_big, headers={"idempotency-key": f"{KEY}-big"})
        assert r.status_code == 413
        # In flight: 409 (transactional) or 202 (lease, accept_while_in_flight).
        app.state.gate.hold = True
        held = asyncio.ensure_future(
            c.post(pay_url, json=body(2), headers={"idempotency-key": f"{KEY}-2"})
        )
        await asyncio.wait_for(app.state.gate.entered.wait(), 10)
        app.state.gate.hold = False
        dup = await c.post(pay_url, json=body(2), headers={"idempotency-key": f"{KEY}-2"})
        assert dup.status_code == (409 if mode == "transactional" else 202), dup.text
        app.state.gate.release.set()
        assert (await asyncio.wait_for(held, 10)).status_code == 201
        # The handler raises: 500 (transactional) or unknown (lease), then its retry.
        for _ in range(2):
            r = await c.post(boom_url, json=body(), headers={"idempotency-key": f"{KEY}-3"})
            assert r.status_code in (500, 409), r.text
        # The status resource, by query and by header.
        status = await c.get(
            "/idempotency/status", params={"operation": f"POST {pay_url}", "key": KEY}
        )
        assert status.status_code == 200, status.text
        r = await c.get(
            "/idempotency/status", params={"operation": f"POST {pay_url}", "key": f"{KEY}\x01"}
        )
        assert r.status_code == 400
    assert_nothing_leaked(logs, registry, exporter, app=app)


async def test_one_time_tokens(pg_store: PostgresStore, logs: Any, observed: Any) -> None:
    observers, registry, exporter = observed
    issuer = TokenIssuer(pg_store, secret=b"s" * 32)
    app = build(pg_store, issuer, observers=observers)
    async with client(app) as c:
        issued = await c.post("/idempotency/tokens", json={"operation": "POST /tok"})
        assert issued.status_code == 201, issued.text
        token = issued.json()["token"]
        again = await c.post(
            "/idempotency/tokens", json={"operation": "POST /tok", "intent_id": PAYLOAD}
        )
        assert again.status_code == 201
        used = await c.post("/tok", json=body(), headers={"idempotency-key": token})
        assert used.status_code == 201
        reused = await c.post("/tok", json=body(9), headers={"idempotency-key": token})
        assert reused.status_code == 422
        forged = await c.post("/tok", json=body(), headers={"idempotency-key": f"{KEY}-forged"})
        assert forged.status_code == 400
    assert_nothing_leaked(logs, registry, exporter, [token, again.json()["token"]], app)


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


async def test_a_store_that_is_down(logs: Any, observed: Any) -> None:
    observers, registry, _ = observed
    dsn = f"postgresql://user:{PAYLOAD}@127.0.0.1:{dead_port()}/db"
    pool = await asyncpg.create_pool(dsn, min_size=0, timeout=1)
    store = PostgresStore(pool=pool, acquire_timeout=1)
    issuer = TokenIssuer(store, secret=b"s" * 32)
    try:
        async with store:  # (its schema cannot be checked now: a warning)
            app = build(store, issuer, observers=observers)
            async with client(app) as c:
                for url in (T_PAY, L_PAY):
                    r = await c.post(url, json=body(), headers={"idempotency-key": KEY})
                    assert r.status_code == 503, r.text
                tokens = await c.post("/idempotency/tokens", json={"operation": "POST /tok"})
                assert tokens.status_code == 503, tokens.text
                status = await c.get(
                    "/idempotency/status", params={"operation": f"POST {T_PAY}", "key": KEY}
                )
                assert status.status_code == 503, status.text
    finally:
        await pool.close()
    assert_nothing_leaked(logs, registry, app=app)


#: A constraint a DBA added, refusing the claim's insert, or only the settlement's update.
REFUSING = {
    "claim": "idem_key NOT LIKE '%REFUSE%'",
    "settlement": "state = 'pending' OR idem_key NOT LIKE '%REFUSE%'",
}


@pytest.mark.parametrize("fast_path", [True, False], indirect=True)
@pytest.mark.parametrize("refused", sorted(REFUSING))
async def test_statements_the_database_refuses(
    db_target: Any, pool: Any, logs: Any, observed: Any, fast_path: bool, refused: str
) -> None:
    """PostgreSQL's DETAIL quotes the row it refused (`Failing row contains (...)`), the key,
    the tenant and the body's bytes in it: a constraint or trigger a DBA added, a partition
    missing. A 500 or 503, and nothing of the row in a log line or a span. With the server's
    `log_parameter_max_length_on_error` set, its CONTEXT quotes every parameter too (found by
    probing: not in the error's text, but in the `context` attribute an error tracker reads)."""
    observers, registry, exporter = observed
    dsn, options = db_target
    await pool.execute(
        f"ALTER TABLE idem_requests ADD CONSTRAINT privacy_probe CHECK ({REFUSING[refused]}) "
        "NOT VALID"
    )
    quoting = await asyncpg.create_pool(
        dsn, min_size=1, max_size=4, server_settings={"log_parameter_max_length_on_error": "-1"},
        **options,
    )  # fmt: skip
    try:
        async with PostgresStore(pool=quoting, fast_path=fast_path) as store:
            issuer = TokenIssuer(store, secret=b"s" * 32)
            app = build(store, issuer, observers=observers)
            async with client(app) as c:
                for url in (T_PAY, L_PAY):
                    key = {"idempotency-key": f"{KEY}-REFUSE"}
                    r = await c.post(url, json=body(), headers=key)
                    assert r.status_code in (500, 503), r.text
    finally:
        await quoting.close()
        await pool.execute("ALTER TABLE idem_requests DROP CONSTRAINT privacy_probe")
    assert_nothing_leaked(logs, registry, exporter, app=app)
    # The refusal is named where it is reported: in the error raised to the server (a
    # settlement's), or in the middleware's log line (a claim's, answered with a problem).
    told = [*app.raised, *logs]
    assert any("privacy_probe" in "".join(t for _, t in _texts(r)) for r in told)


def test_a_translated_unique_violation_names_no_key() -> None:
    """The library's own exceptions: StatementRefused (and StoreError) say what was refused,
    not the row; the driver's error they are raised from says no more."""
    violation = asyncpg.exceptions.UniqueViolationError(
        'duplicate key value violates unique constraint "idem_tokens_pkey"'
    )
    violation.detail = f"Key (tenant, token_hash)=({TENANT}, {KEY}) already exists."
    try:
        try:
            raise violation
        except asyncpg.PostgresError as exc:
            raise translate(exc) from exc
    except StatementRefused as refused:
        text = "".join(traceback.format_exception(refused))
    assert "idem_tokens_pkey" in text
    assert KEY not in text
    assert TENANT not in text


async def test_operator_commands_and_reconciliation(
    pg_store: PostgresStore, pool: Any, logs: Any, observed: Any
) -> None:
    observers, _, _ = observed
    issuer = TokenIssuer(pg_store, secret=b"s" * 32)
    app = build(pg_store, issuer, observers=observers)
    async with client(app) as c:
        for n in range(3):
            r = await c.post(L_BOOM, json=body(), headers={"idempotency-key": f"{KEY}-{n}"})
            assert r.status_code == 500, r.text

    async def reconciler(ctx: ReconcileContext) -> Reconciliation:
        if ctx.key.endswith("-0"):
            raise RuntimeError("the bank is down")
        return StillUnknown("not yet")

    report = await reconcile_unknown(pg_store, {OP_L_BOOM: reconciler}, seconds=5)
    assert report.examined == 3
    parser = cli_module._parser()
    common = ["--tenant", TENANT, "--operation", OP_L_BOOM]
    resolved = parser.parse_args(
        ["resolve", *common, "--key", f"{KEY}-1", "--to", "succeeded", "--status", "201",
         "--body", f'{{"r": "{RESP}"}}', "--content-type", "application/json", "--note", "n"]
    )  # fmt: skip
    assert await cli_commands.resolve(pg_store, resolved) == 0
    reopened = parser.parse_args(["reopen", *common, "--key", f'"{KEY}-1"', "--note", "n"])
    assert await cli_commands.reopen(pg_store, reopened) == 0
    missing = parser.parse_args(["reopen", *common, "--key", f"{KEY}-none", "--note", "n"])
    with pytest.raises(IdempotencyError):
        await cli_commands.reopen(pg_store, missing)
    assert await pg_store.get(RecordKey(TENANT, OP_L_BOOM, f"{KEY}-2")) is not None
    assert_nothing_leaked(logs, app=app)


async def test_outbox_failures(pg_store: PostgresStore, pool: Any, logs: Any) -> None:
    """A receiver answering 500 with the payload echoed back; and a send whose result the
    database refuses to record."""

    def receiver(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, text=request.content.decode())

    async with pool.acquire() as conn, conn.transaction():
        await add(conn, tenant=TENANT, topic="paid", payload={"p": PAYLOAD}, event_id="e1")
    async with httpx.AsyncClient(transport=httpx.MockTransport(receiver)) as http:
        publisher = Publisher(pool, webhook_sender(http, "http://receiver/hook"), max_attempts=2)
        for _ in range(2):
            await pool.execute("UPDATE idem_outbox SET next_attempt_at = now()")
            await publisher.publish_batch()
    assert_nothing_leaked(logs)


async def test_startup_warnings(pg_store: PostgresStore, logs: Any) -> None:
    issuer = TokenIssuer(pg_store, secret=b"s" * 32)
    app = build(pg_store, issuer)
    async with client(app) as c:
        await c.post(T_PAY, json=body(), headers={"idempotency-key": KEY})
    assert any("guarding" in r.getMessage() for r in logs)
    assert_nothing_leaked(logs, app=app)


#: Values a client puts in a path, percent-encoded as sent: a line break that would forge a log
#: line of its own, a terminal escape sequence, a long value (as long as an operation's name may
#: be: longer is refused, test_unnameable_operation.py), bytes that are not UTF-8.
HOSTILE = ["a%0D%0AFORGED%20line", "%1B%5B31mred%1B%5B0m", "x" * 1000, "%C3%28", "%7F%08"]


def broken_hook(response: Any, scope: Any) -> Any:
    raise RuntimeError("the replay hook failed")


async def test_what_a_client_put_in_a_path_forges_no_log_line(
    pg_store: PostgresStore, logs: Any
) -> None:
    """Found by probing: a replay hook's failure was logged at ERROR with the request's path as
    the server decoded it, so `%0D%0A` in a path parameter forged a log line of its own (and a
    path of any length was logged whole). It is named by its operation now, shown escaped and
    cut where it is a concrete path (a sub-app behind a wrapper the router cannot see into)."""
    hooked = Policy(replay_hook=broken_hook, wait_seconds=0.2)
    guarded = {"store": pg_store, "default_policy": hooked, "tenant_resolver": lambda s: TENANT}
    inner = Starlette(
        routes=[Route("/pay", pay, methods=["POST"])],
        middleware=[Middleware(IdempotencyMiddleware, **guarded)],  # type: ignore[arg-type]
    )

    async def hiding(scope: Any, receive: Any, send: Any) -> None:  # no `.app` to look into
        await inner(scope, receive, send)

    app = Starlette(
        routes=[Route("/items/{name}", pay, methods=["POST"]), Mount("/w/{name}", app=hiding)],
        middleware=[Middleware(IdempotencyMiddleware, **guarded)],  # type: ignore[arg-type]
    )
    app.state.gate = inner.state.gate = Gate()
    async with client(app) as c:
        for n, value in enumerate(HOSTILE):
            for path in (f"/items/{value}", f"/w/{value}/pay"):
                for _ in range(2):  # the second is a replay: the hook fails
                    k = {"idempotency-key": f"{KEY}-{n}-{len(path)}"}
                    r = await c.post(path, json=body(), headers=k)
                    assert r.status_code == 201, r.text
    failed = [r for r in logs if "replay hook failed" in r.getMessage()]
    assert len(failed) == 2 * len(HOSTILE)
    for record in logs:
        if record.name.startswith("idem_middleware"):
            message = record.getMessage()
            assert message.isprintable(), message
            assert len(message) < 500, message
    assert_nothing_leaked(logs)

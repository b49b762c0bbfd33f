"""The example app over real HTTP, started as a process (docs/example-app.md: credits)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import psutil
import pytest

from example_app.launcher import ServerProcess, stop_embedded_postgres
from tests.conftest import _fresh_database

A = {"authorization": "Bearer demo-a"}
B = {"authorization": "Bearer demo-b"}


def key() -> dict[str, str]:
    return {"idempotency-key": f'"{uuid.uuid4()}"'}


@pytest.fixture(scope="module")
async def app_db(admin_dsn: str) -> str:
    return await _fresh_database(admin_dsn, "idem_example_e2e")


@pytest.fixture(scope="module")
def server(app_db: str) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "example_app", "--workers", "2", env={"DATABASE_URL": app_db}, ready_path="/accounts/x"
    ).start()
    try:
        yield proc
    finally:
        proc.cleanup()


@pytest.fixture
async def http(server: ServerProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
        yield c


async def _count(dsn: str, sql: str, *args: Any) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        value: int = await conn.fetchval(sql, *args)
        return value
    finally:
        await conn.close()


async def test_two_workers_fifty_concurrent_requests_one_key_one_execution(
    http: httpx.AsyncClient, app_db: str
) -> None:
    headers = {**A, **key()}
    account = f"acc-{uuid.uuid4().hex[:8]}"

    async def one() -> httpx.Response:
        return await http.post(f"/accounts/{account}/credits", json={"amount": 7}, headers=headers)

    # Fresh connections for each request, so both worker processes take a share.
    async with asyncio.timeout(60):
        responses = await asyncio.gather(*(one() for _ in range(50)))
    statuses = [r.status_code for r in responses]
    bodies = {r.text for r in responses if r.status_code == 201}
    assert set(statuses) <= {201, 409}, statuses
    assert statuses.count(201) >= 1
    assert len(bodies) == 1  # every 201, original or replay, is the same response
    assert sum(r.headers.get("idempotent-replayed") == "true" for r in responses) == (
        statuses.count(201) - 1
    )
    credits = await _count(app_db, "SELECT count(*) FROM ex_credits WHERE account_id = $1", account)
    balance = await _count(app_db, "SELECT balance FROM ex_accounts WHERE account_id = $1", account)
    assert (credits, balance) == (1, 7)


async def test_credit_replay_reuse_and_account(http: httpx.AsyncClient) -> None:
    h = {**A, **key()}
    first = await http.post("/accounts/acc-r/credits", json={"amount": 5, "memo": "m"}, headers=h)
    assert first.status_code == 201
    body = first.json()
    assert set(body) == {"credit_id", "account_id", "amount", "balance"}
    assert (body["account_id"], body["amount"]) == ("acc-r", 5)
    again = await http.post(
        "/accounts/acc-r/credits",
        content=b'{ "memo": "m", "amount": 5.0 }',
        headers={**h, "content-type": "application/json"},
    )
    assert again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == body
    reused = await http.post("/accounts/acc-r/credits", json={"amount": 6}, headers=h)
    assert reused.status_code == 422
    assert reused.headers["content-type"] == "application/problem+json"
    assert reused.json()["type"].endswith("key-reused")
    account = await http.get("/accounts/acc-r", headers=A)
    assert account.status_code == 200
    assert account.json() == {"account_id": "acc-r", "balance": body["balance"], "credits": 1}


async def test_bad_requests_are_refused_and_not_stored(http: httpx.AsyncClient) -> None:
    missing = await http.post("/accounts/acc-x/credits", json={"amount": 1}, headers=A)
    assert missing.status_code == 400
    assert missing.json()["type"].endswith("missing-key")
    bad = await http.post(
        "/accounts/acc-x/credits", json={"amount": 1}, headers={**A, "idempotency-key": "x" * 256}
    )
    assert bad.status_code == 400
    assert bad.json()["type"].endswith("invalid-key")
    h = {**A, **key()}
    invalid = await http.post(
        "/accounts/acc-x/credits", json={"amount": -1, "memo": "private"}, headers=h
    )
    assert invalid.status_code == 422  # the app's validation error: not stored, key released
    # A problem document, as every other refusal, naming the field, never echoing the value.
    assert invalid.headers["content-type"] == "application/problem+json"
    problem = invalid.json()
    assert (problem["status"], problem["detail"]) == (422, "the request is not valid")
    assert [e["loc"] for e in problem["errors"]] == [["body", "amount"]]
    assert "-1" not in invalid.text
    fixed = await http.post("/accounts/acc-x/credits", json={"amount": 1}, headers=h)
    assert fixed.status_code == 201
    assert "idempotent-replayed" not in fixed.headers


async def test_the_routers_own_refusals_are_problems_too(http: httpx.AsyncClient) -> None:
    """A path no route serves, and a method a route does not take, answer in the RFC 9457 shape
    the app's own refusals use (they were FastAPI's plain `{"detail": ...}`)."""
    for response, status in [
        (await http.get("/no/such/path", headers=A), 404),
        (await http.delete("/accounts/acc-x/credits", headers=A), 405),
    ]:
        assert response.status_code == status
        assert response.headers["content-type"] == "application/problem+json"
        assert response.json()["status"] == status
    assert "allow" in response.headers  # (405's Allow kept)


async def test_authentication_and_tenant_isolation(http: httpx.AsyncClient) -> None:
    anonymous = await http.post("/accounts/acc-t/credits", json={"amount": 1}, headers=key())
    assert anonymous.status_code == 401
    wrong = await http.post(
        "/accounts/acc-t/credits",
        json={"amount": 1},
        headers={"authorization": "Bearer nope", **key()},
    )
    assert wrong.status_code == 401
    read = await http.get("/accounts/acc-t")
    assert read.status_code == 401
    # The middleware's 401s (a guarded POST) and the app's own (a GET) name the same scheme.
    for refused in (anonymous, wrong, read):
        assert refused.headers.get_list("www-authenticate") == ["Bearer"]
    shared_key = key()
    a = await http.post("/accounts/acc-t/credits", json={"amount": 3}, headers={**A, **shared_key})
    b = await http.post("/accounts/acc-t/credits", json={"amount": 3}, headers={**B, **shared_key})
    assert (a.status_code, b.status_code) == (201, 201)
    assert "idempotent-replayed" not in b.headers
    assert a.json()["credit_id"] != b.json()["credit_id"]
    assert (await http.get("/accounts/acc-t", headers=A)).json()["credits"] == 1
    assert (await http.get("/accounts/acc-t", headers=B)).json()["credits"] == 1
    assert (await http.get("/accounts/acc-only-a", headers=B)).status_code == 404


async def test_embedded_default_survives_a_crash_and_keeps_stored_responses(
    tmp_path: Path,
) -> None:
    """No DATABASE_URL: the app runs PostgreSQL in .example_app/ under its working directory."""
    h = {**A, **key()}
    app = ServerProcess(
        "example_app", cwd=tmp_path, unset=["DATABASE_URL"], ready_path="/accounts/x"
    )
    try:
        app.start(timeout=90)
        async with httpx.AsyncClient(base_url=app.url, timeout=30) as c:
            first = await c.post("/accounts/e1/credits", json={"amount": 9}, headers=h)
        assert first.status_code == 201
        assert (tmp_path / ".example_app" / "pgdata" / "PG_VERSION").exists()
        app.kill()  # SIGKILL: no shutdown hooks run
        app.start(timeout=90)
        async with httpx.AsyncClient(base_url=app.url, timeout=30) as c:
            again = await c.post("/accounts/e1/credits", json={"amount": 9}, headers=h)
            account = await c.get("/accounts/e1", headers=A)
        assert again.status_code == 201
        assert again.headers["idempotent-replayed"] == "true"
        assert again.json() == first.json()
        assert account.json() == {"account_id": "e1", "balance": 9, "credits": 1}
    finally:
        app.cleanup()
        stop_embedded_postgres(tmp_path / ".example_app" / "pgdata")


async def test_a_second_app_on_the_same_embedded_database_does_not_stop_it_under_the_first(
    tmp_path: Path,
) -> None:
    """Found by probing: `python -m example_app` started again in the same directory (another
    port, or the same one by mistake: it cannot bind and exits) stopped the embedded PostgreSQL
    at exit, under the app still running on it. The last app to exit stops it."""
    pgdata = tmp_path / ".example_app" / "pgdata"
    first = ServerProcess("example_app", cwd=tmp_path, unset=["DATABASE_URL"], ready_path="/")
    second = ServerProcess("example_app", cwd=tmp_path, unset=["DATABASE_URL"], ready_path="/")
    try:
        first.start(timeout=90)
        second.start(timeout=90)
        second.stop()  # SIGTERM: its exit hooks run
        async with httpx.AsyncClient(base_url=first.url, timeout=30) as c:
            credit = await c.post(
                "/accounts/s1/credits", json={"amount": 2}, headers={**A, **key()}
            )
        assert credit.status_code == 201, credit.text
        assert (pgdata / "postmaster.pid").exists()
        first.stop()
        assert not (pgdata / "postmaster.pid").exists()  # the last one out stopped it
    finally:
        first.cleanup()
        second.cleanup()
        stop_embedded_postgres(pgdata)


async def test_values_the_database_cannot_keep_are_422_and_release_the_key(
    http: httpx.AsyncClient,
) -> None:
    """Found by probing: a NUL in the account id or the memo, an account id longer than the
    accounts' index takes, or an amount past bigint reached PostgreSQL and answered 500; and
    `true` or `"5"` were taken as amounts, and so were floats (`9007199254740993.0` rounded to
    another amount). Each is a 422 now, and the key stays free."""
    cases = [
        ("/accounts/a%00b/credits", {"amount": 1}),
        ("/accounts/acc-v/credits", {"amount": 1, "memo": "a\x00b"}),
        (f"/accounts/{uuid.uuid4().hex * 100}/credits", {"amount": 1}),
        ("/accounts/acc-v/credits", {"amount": 2**63}),
        ("/accounts/acc-v/credits", {"amount": True}),
        ("/accounts/acc-v/credits", {"amount": "5"}),
        ("/accounts/acc-v/credits", {"amount": 5.0}),
        ("/accounts/acc-v/credits", {"amount": 9007199254740993.0}),
    ]
    for path, body in cases:
        h = {**A, **key()}
        refused = await http.post(path, json=body, headers=h)
        assert refused.status_code == 422, (path, body, refused.text)
        fixed = await http.post("/accounts/acc-v/credits", json={"amount": 1}, headers=h)
        assert fixed.status_code == 201, (path, body, fixed.text)
        assert "idempotent-replayed" not in fixed.headers
    assert (await http.get("/accounts/a%00b", headers=A)).status_code == 422
    account = f"acc-{uuid.uuid4().hex[:8]}"
    full = await http.post(
        f"/accounts/{account}/credits", json={"amount": 2**63 - 1}, headers={**A, **key()}
    )
    assert full.status_code == 201, full.text
    h = {**A, **key()}
    overflow = await http.post(f"/accounts/{account}/credits", json={"amount": 1}, headers=h)
    assert overflow.status_code == 422, overflow.text
    assert overflow.headers["content-type"] == "application/problem+json"
    after = (await http.get(f"/accounts/{account}", headers=A)).json()
    assert (after["balance"], after["credits"]) == (2**63 - 1, 1)  # the credit rolled back
    fixed = await http.post("/accounts/acc-v/credits", json={"amount": 1}, headers=h)
    assert fixed.status_code == 201, fixed.text


@pytest.mark.parametrize("database", ["unreachable", "closed for maintenance"])
async def test_reading_an_account_while_the_database_is_unreachable_is_a_503(
    database: str, pg_dsn: str
) -> None:
    """Found by probing: GET /accounts/{id} answered a bare text/plain 500 while PostgreSQL was
    restarting, or while its database took no connections (`ALLOW_CONNECTIONS false`, 55000);
    the guarded routes answer 503 problem+json with Retry-After, and so does it."""
    from example_app.app import create_app
    from idem_middleware.ops import find_middleware

    free = ServerProcess("example_app").port  # a port nothing listens on
    dsn = f"postgresql://postgres@127.0.0.1:{free}/none"
    if database != "unreachable":
        name = f"idem_closed_{uuid.uuid4().hex[:8]}"
        dsn = await _fresh_database(pg_dsn, name, "ALLOW_CONNECTIONS false")
    app = create_app(f"postgresql://postgres@127.0.0.1:{free}/none")
    middleware = find_middleware(app)
    assert middleware is not None
    # The store's pool, as if the server went away after startup (min_size 0: opened lazily).
    middleware.store._pool = await asyncpg.create_pool(dsn, min_size=0)  # type: ignore[attr-defined]
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.get("/accounts/acc-1", headers=A)
    finally:
        await middleware.store._pool.close()  # type: ignore[attr-defined]
        if database != "unreachable":
            admin = await asyncpg.connect(pg_dsn)
            try:
                await admin.execute(f'DROP DATABASE "{name}"')
            finally:
                await admin.close()
    assert r.status_code == 503, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert r.headers["retry-after"] == "1"
    assert r.json()["status"] == 503


def test_workers_of_a_sigkilled_supervisor_stop_and_free_the_port(app_db: str) -> None:
    """Found by probing: `kill -9` of `python -m example_app --workers 2` (the PID it prints,
    not its process group) left both workers serving the port and the bank running, and a
    restart failed with "address already in use". They notice, and stop themselves."""
    app = ServerProcess(
        "example_app", "--workers", "2", env={"DATABASE_URL": app_db}, ready_path="/accounts/x"
    )
    try:
        app.start()
        children = psutil.Process(app.pid).children(recursive=True)
        assert len(children) >= 3  # two workers and the bank (and multiprocessing's tracker)
        os.kill(app.pid, signal.SIGKILL)  # the supervisor only
        app.proc.wait(10)  # type: ignore[union-attr]
        _, alive = psutil.wait_procs(children, timeout=30)
        assert alive == [], alive
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{app.url}/accounts/x", timeout=2)
    finally:
        with contextlib.suppress(ProcessLookupError):  # whatever is left of the group
            os.killpg(app.pid, signal.SIGKILL)
        app.cleanup()


@pytest.mark.parametrize("module", ["example_app", "example_app.bank"])
@pytest.mark.parametrize("port", ["99999", "-5"])
def test_a_port_out_of_range_is_a_usage_error(module: str, port: str, tmp_path: Path) -> None:
    """Before, uvicorn bound 99999 as 34463 while announcing "running on ...:99999" (and -5
    was a resolver's error, exit 3)."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", module, "--port", port],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        cwd=tmp_path,  # (an app that got past its arguments puts its database there)
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert result.returncode == 2, result.stderr
    assert f"argument --port: '{port}' is not a port number (0 to 65535)" in result.stderr


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        # Before, `false` (anything but 0) ran a publisher in every worker.
        ("EXAMPLE_PUBLISH", "false", "EXAMPLE_PUBLISH='false' is 1 (each worker publishes) or 0"),
        # Before, float()'s message, naming no variable.
        ("EXAMPLE_LEASE_SECONDS", "abc", "EXAMPLE_LEASE_SECONDS='abc' is not a number of seconds"),
        ("EXAMPLE_BANK_TIMEOUT", "0", "EXAMPLE_BANK_TIMEOUT='0' is not a number of seconds"),
        # Before, taken as it was: every payout's bank call failed after its funds were held,
        # and the payout was `unknown` until an operator stepped in (found by probing).
        ("BANK_URL", "bank:8001", "BANK_URL='bank:8001' is not the bank's http(s) URL"),
        ("BANK_URL", "ftp://bank", "BANK_URL='ftp://bank' is not the bank's http(s) URL"),
    ],
)
def test_a_setting_the_app_cannot_use_is_refused_naming_it(
    name: str, value: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from example_app.app import create_app

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        create_app("postgresql://unused/x")


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("EXAMPLE_PUBLISH", "false", "EXAMPLE_PUBLISH='false' is 1 (each worker publishes) or 0"),
        ("BANK_URL", "garbage", "BANK_URL='garbage' is not the bank's http(s) URL"),
    ],
)
def test_a_setting_the_app_cannot_use_stops_the_command_with_its_message_alone(
    name: str, value: str, message: str, tmp_path: Path
) -> None:
    """Before, uvicorn's 14 frames of traceback from the app's factory, the message on the last
    line (found by probing); and a database started for nothing."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "example_app", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        cwd=tmp_path,
        env={
            **os.environ,
            "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
            name: value,
        },
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"python -m example_app: {message}")
    assert "Traceback" not in result.stderr
    assert result.stdout == ""  # (no database was started: its address is printed first)
    assert not (tmp_path / ".example_app").exists()


def test_the_documented_settings_are_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    from example_app.app import create_app

    for name, value in [
        ("EXAMPLE_PUBLISH", "0"),
        ("EXAMPLE_WAIT_SECONDS", "0"),
        ("EXAMPLE_LEASE_SECONDS", "2.5"),
        ("EXAMPLE_BANK_TIMEOUT", "2"),
        ("BANK_URL", "http://bank:8001"),
    ]:
        monkeypatch.setenv(name, value)
    create_app("postgresql://unused/x")

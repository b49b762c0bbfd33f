"""The operator's tools cannot wedge a key or be knocked over by bad input: reconcile leaves
transactional records to `resolve`, a reconciler's wrong answer is a failed reconciliation, and
the command line refuses bad numbers (from its options or the environment) with exit 2."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse

from idem_middleware import Mode, cli_commands, idempotent
from idem_middleware import cli as cli_module
from idem_middleware.errors import StoreError
from idem_middleware.fence import Verdict, run_reconciler
from idem_middleware.ops import (
    Resolution,
    ResolveError,
    operator_response,
    reconcile_unknown,
    reopen,
    resolve,
)
from idem_middleware.reconcile import Happened, NotHappened, ReconcileContext, Reconciliation
from idem_middleware.store import Claimed
from idem_middleware.store.base import RecordKey, Settlement, State, Store, StoredResponse
from tests.apps import LEDGER_INSERT, assert_problem, client, count, one_route_app
from tests.integration.test_cli import cli, insert

ROOT = Path(__file__).resolve().parents[2]
RECORD = ("--tenant", "t", "--operation", "POST /payouts")
KEY = RecordKey("t", "POST /payouts", "k")
FAILED = "Asking the downstream system failed; retry later."
HEADERS = {"idempotency-key": "k"}


async def _transactional_unknown(store: Store) -> int:
    """A transactional record that succeeded, then reopened by an operator: its generation."""
    async with store.transaction(acquire_timeout=5) as tx:
        claim = await tx.claim(KEY, b"f", retention_seconds=60, wait_seconds=1)
        assert isinstance(claim, Claimed)
        await tx.finish(State.SUCCEEDED, StoredResponse(201, [], b""))
    await reopen(store, KEY, note="checking with the bank")
    record = await store.get(KEY)
    assert record is not None
    assert record.state is State.UNKNOWN
    return record.generation


async def _lease_unknown(store: Store) -> int:
    claim = await store.claim_lease(KEY, b"f", retention_seconds=60, lease_seconds=30)
    assert isinstance(claim, Claimed)
    assert await store.settle(KEY, claim.generation, State.PENDING, Settlement(State.UNKNOWN))
    return claim.generation


# -- a transactional record is never released for a retry ---------------------------------------


async def test_allow_retry_moves_only_lease_mode_records(store: Store) -> None:
    generation = await _transactional_unknown(store)
    assert await store.allow_retry(KEY, generation, "reconciled: not happened") is False
    record = await store.get(KEY)
    assert record is not None
    assert (record.state, record.generation) == (State.UNKNOWN, generation)
    other = RecordKey("t", "POST /payouts", "lease")
    claim = await store.claim_lease(other, b"f", retention_seconds=60, lease_seconds=30)
    assert isinstance(claim, Claimed)
    assert await store.settle(other, claim.generation, State.PENDING, Settlement(State.UNKNOWN))
    assert await store.allow_retry(other, claim.generation, "reconciled: not happened") is True


async def test_records_no_reconciler_can_settle_never_keep_others_from_their_turn(
    store: Store,
) -> None:
    """`limit` bounds the reconcilers run: however many older unknown records wait for an
    operator (an operation without a reconciler), the batch reaches the ones it can settle."""

    async def unknown(operation: str, key: str) -> None:
        record_key = RecordKey("t", operation, key)
        claim = await store.claim_lease(record_key, b"f", retention_seconds=60, lease_seconds=30)
        assert isinstance(claim, Claimed)
        assert await store.settle(
            record_key, claim.generation, State.PENDING, Settlement(State.UNKNOWN)
        )

    for i in range(5):
        await unknown("POST /by-hand", f"old-{i}")
    for i in range(2):
        await unknown("POST /payouts", f"new-{i}")

    async def happened(ctx: ReconcileContext) -> Reconciliation:
        return Happened(201, b"{}")

    report = await reconcile_unknown(store, {"POST /payouts": happened}, limit=2)
    assert report.verdicts == {"settled": 2}
    assert report.unreconcilable == {"POST /by-hand": 5}
    for i in range(2):
        record = await store.get(RecordKey("t", "POST /payouts", f"new-{i}"))
        assert record is not None
        assert record.state is State.SUCCEEDED
    # Past the budget, nothing more is asked: 3 more to settle, a budget of 1.
    for i in range(3):
        await unknown("POST /payouts", f"later-{i}")
    report = await reconcile_unknown(store, {"POST /payouts": happened}, limit=1)
    assert report.verdicts == {"settled": 1}


async def test_reconcile_leaves_a_reopened_transactional_record_to_resolve(store: Store) -> None:
    ran: list[int] = []

    async def pay(request: Request) -> JSONResponse:
        await request.body()
        ran.append(1)
        return JSONResponse({"n": len(ran)}, status_code=201)

    asked: list[str] = []

    async def not_happened(ctx: ReconcileContext) -> Reconciliation:
        asked.append(ctx.key)
        return NotHappened()

    app = one_route_app("/txpay", idempotent()(pay), store=store)
    record_key = RecordKey("tenant-a", "POST /txpay", "k")
    async with client(app) as c:
        first = await c.post("/txpay", headers=HEADERS, json={"a": 1})
        assert first.status_code == 201
        await reopen(store, record_key, note="the bank lost it")
        report = await reconcile_unknown(store, {"POST /txpay": not_happened})
        assert (report.examined, report.by_hand, report.verdicts) == (1, {"POST /txpay": 1}, {})
        assert asked == []  # no reconciler runs on a transactional record
        summary = await store.describe(record_key)
        assert summary is not None
        assert summary.state is State.UNKNOWN
        retry = await c.post("/txpay", headers=HEADERS, json={"a": 1})
        assert_problem(retry, 409, "outcome-unknown")
        # Still the operator's to settle: resolve takes it.
        created = operator_response(Resolution.SUCCEEDED, 201, b'{"n": 1}')
        await resolve(store, record_key, Resolution.SUCCEEDED, note="bank has it", response=created)
        replay = await c.post("/txpay", headers=HEADERS, json={"a": 1})
        assert (replay.status_code, replay.headers.get("idempotent-replayed")) == (201, "true")
    assert ran == [1]


async def test_a_transactional_record_an_older_reconcile_left_pending_can_be_resolved(
    pg_store: Store, pool: Any
) -> None:
    """A transactional record that reads pending (committed) can only be one an older version's
    reconcile released: no lease lapses to free it, and every retry was 409. An operator may
    settle it to an outcome, never release it for a retry (its writes committed)."""
    ran: list[int] = []

    async def pay(request: Request) -> JSONResponse:
        await request.body()
        ran.append(1)
        return JSONResponse({"n": len(ran)}, status_code=201)

    app = one_route_app("/txpay", idempotent()(pay), store=pg_store)
    record_key = RecordKey("tenant-a", "POST /txpay", "k")
    async with client(app) as c:
        assert (await c.post("/txpay", headers=HEADERS, json={"a": 1})).status_code == 201
        # What reopen, then the old reconcile's allow_retry, did to it:
        await reopen(pg_store, record_key, note="the bank lost it")
        await pool.execute(
            "UPDATE idem_requests SET state = 'pending', lease_expires_at = NULL, "
            "generation = nextval('idem_generation_seq') WHERE idem_key = 'k'"
        )
        assert_problem(
            await c.post("/txpay", headers=HEADERS, json={"a": 1}), 409, "request-in-flight"
        )
        with pytest.raises(ResolveError, match="cannot be released for a retry"):
            await resolve(pg_store, record_key, Resolution.RETRY, note="try again")
        created = operator_response(Resolution.SUCCEEDED, 201, b'{"n": 1}')
        await resolve(pg_store, record_key, Resolution.SUCCEEDED, note="it ran", response=created)
        replay = await c.post("/txpay", headers=HEADERS, json={"a": 1})
        assert (replay.status_code, replay.headers.get("idempotent-replayed")) == (201, "true")
    assert ran == [1]


async def test_a_lease_record_in_flight_is_still_not_resolved(pg_store: Store, pool: Any) -> None:
    await pool.execute(
        "INSERT INTO idem_requests (tenant, operation, idem_key, fingerprint, state, mode, "
        "retention, lease_expires_at) VALUES ('t', 'POST /payouts', 'running', '\\x00', "
        "'pending', 'lease', interval '1 day', now() + interval '1 minute')"
    )
    created = operator_response(Resolution.SUCCEEDED, 201, b"{}")
    with pytest.raises(ResolveError, match="pending"):
        await resolve(
            pg_store,
            RecordKey("t", "POST /payouts", "running"),
            Resolution.SUCCEEDED,
            note="no",
            response=created,
        )


async def test_cli_reconcile_prints_stored_operation_names_escaped(db_dsn: str, pool: Any) -> None:
    """An operation name is stored as the request named it (behind a mount the router cannot
    see into, the client's own path), and reconcile's text printed it raw: an ESC there is a
    terminal escape sequence in the operator's terminal."""
    await pool.execute(
        "INSERT INTO idem_requests (tenant, operation, idem_key, fingerprint, state, mode, "
        "retention) VALUES ('t', $1, 'k', '\\x00', 'unknown', 'lease', interval '1 day')",
        "POST /hidden/\x1b]0;pwned\x07",
    )
    text = cli("reconcile", "--app", "tests.cli_app:app", dsn=db_dsn)
    assert text.returncode == 0, text.stderr
    assert "\x1b" not in text.stdout
    assert "no reconciler for POST /hidden/\\x1b]0;pwned\\x07: 1" in text.stdout


async def test_cli_reconcile_reports_transactional_records_to_resolve(
    db_dsn: str, pool: Any
) -> None:
    # A record the route wrote in transactional mode, before it moved to lease mode with a
    # reconciler (tests/cli_app.py answers NotHappened for this key).
    await pool.execute(
        "INSERT INTO idem_requests (tenant, operation, idem_key, fingerprint, state, mode, "
        "retention) VALUES ('t', 'POST /payouts', 'not-happened', '\\x00', 'unknown', "
        "'transactional', interval '1 day')"
    )
    await insert(pool, "happened", "unknown")
    result = cli("reconcile", "--app", "tests.cli_app:app", "--json", dsn=db_dsn)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["examined"], report["verdicts"]) == (2, {"settled": 1})
    assert report["by_hand"] == {"POST /payouts": 1}
    text = cli("reconcile", "--app", "tests.cli_app:app", dsn=db_dsn)
    assert "reopened, not reconciled (settle with resolve) for POST /payouts: 1" in text.stdout
    state = "SELECT state FROM idem_requests WHERE idem_key = 'not-happened'"
    assert await pool.fetchval(state) == "unknown"
    settled = cli(
        "resolve",
        *RECORD,
        *("--key", "not-happened", "--to", "succeeded", "--status", "201"),
        *("--note", "bank statement shows it"),
        dsn=db_dsn,
    )
    assert settled.returncode == 0, settled.stderr
    assert await pool.fetchval(state) == "succeeded"


# -- a reconciler's wrong answer is a failed reconciliation --------------------------------------


def _happened(status: Any, body: Any = b"", headers: Any = ()) -> Happened:
    """A Happened as a reconciler without type checking might build it."""
    return Happened(status, body, headers)


WRONG_ANSWERS = [
    pytest.param(None, "it returned None", id="none"),
    pytest.param("happened", "it returned str", id="str"),
    pytest.param(Happened(409, b"secret-body"), "Happened(409): not a final outcome", id="409"),
    pytest.param(Happened(500, b"secret-body"), "Happened(500): not a final outcome", id="500"),
    pytest.param(Happened(101), "Happened(101): not a final outcome", id="101"),
    pytest.param(Happened(999), "Happened(999): not an HTTP status", id="999"),
    pytest.param(_happened("201"), "Happened('201'): not an HTTP status", id="text-status"),
    pytest.param(_happened(201, "secret-body"), "body is a str", id="text-body"),
    pytest.param(_happened(201, b"", [("a", "b")]), "not (bytes, bytes) pairs", id="text-headers"),
    # Found by probing: stored, each made every replay a dropped connection for the retention.
    pytest.param(
        Happened(201, b"", [(b"x-note", b"secret-body\r\nx-injected: 1")]),
        "the header b'x-note' is not valid in HTTP",
        id="line-break-in-a-value",
    ),
    pytest.param(
        Happened(201, b"", [(b"x note", b"secret-body")]),
        "the header b'x note' is not valid in HTTP",
        id="space-in-a-name",
    ),
    # Also found by probing: httptools refuses every control character, h11 an edge space.
    pytest.param(
        Happened(201, b"", [(b"x-note", b"secret\x01body")]),
        "the header b'x-note' is not valid in HTTP",
        id="control-character-in-a-value",
    ),
    pytest.param(
        Happened(201, b"", [(b"x-note", b"secret-body ")]),
        "the header b'x-note' is not valid in HTTP",
        id="trailing-space-in-a-value",
    ),
]


@pytest.mark.parametrize(("answer", "logged"), WRONG_ANSWERS)
async def test_a_wrong_answer_fails_the_reconciliation_and_is_logged(
    store: Store, answer: Any, logged: str, caplog: pytest.LogCaptureFixture
) -> None:
    generation = await _lease_unknown(store)

    async def wrong(ctx: ReconcileContext) -> Any:
        return answer

    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        result = await run_reconciler(store, KEY, generation, wrong, seconds=5)
    assert (result.verdict, result.reason) == (Verdict.FAILED, FAILED)
    record = await store.get(KEY)
    assert record is not None
    assert (record.state, record.generation) == (State.UNKNOWN, generation)
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert logged in warning.getMessage()
    assert "secret-body" not in warning.getMessage()


async def test_a_wrong_answer_rolls_back_the_reconcilers_writes(pg_store: Store, pool: Any) -> None:
    generation = await _lease_unknown(pg_store)

    async def writes_then_conflict(ctx: ReconcileContext) -> Reconciliation:
        conn = await ctx.fenced_connection()
        await conn.execute(LEDGER_INSERT, ctx.tenant, "acc-1", 100)
        return Happened(409)

    result = await run_reconciler(pg_store, KEY, generation, writes_then_conflict, seconds=5)
    assert result.verdict is Verdict.FAILED
    assert await count(pool, "test_ledger") == 0
    # The fence let go of the record's row: an operator's move goes through at once.
    await resolve(pg_store, KEY, Resolution.RETRY, note="no transfer at the bank")


@pytest.mark.parametrize("answer", [None, Happened(409)], ids=["none", "409"])
async def test_a_clients_retry_gets_outcome_unknown_after_a_wrong_answer(
    store: Store, answer: Any
) -> None:
    ran: list[int] = []

    async def wrong(ctx: ReconcileContext) -> Any:
        return answer

    async def lost(request: Request) -> JSONResponse:
        await request.body()
        ran.append(1)
        return JSONResponse({}, status_code=502)  # lease mode: the outcome is unknown

    handler = idempotent(mode=Mode.LEASE, reconciler=wrong)(lost)
    app = one_route_app("/payouts", handler, store=store)
    async with client(app) as c:
        assert (await c.post("/payouts", headers=HEADERS, json={})).status_code == 502
        for _ in range(2):
            retry = await c.post("/payouts", headers=HEADERS, json={})
            problem = assert_problem(retry, 409, "outcome-unknown")
            assert FAILED in problem["detail"]
    assert ran == [1]


BAD_ANSWERS_APP = """
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, MemoryStore, Mode, idempotent
from idem_middleware.reconcile import Happened

ANSWERS = {"none": None, "conflict": Happened(409, b"secret-body"), "happened": Happened(201)}


async def reconcile(ctx):
    return ANSWERS[ctx.key]


@idempotent(mode=Mode.LEASE, reconciler=reconcile)
async def payouts(request):
    return JSONResponse({}, status_code=201)


app = Starlette(
    routes=[Route("/payouts", payouts, methods=["POST"])],
    middleware=[Middleware(IdempotencyMiddleware, store=MemoryStore())],
)
"""


async def test_cli_reconcile_goes_on_after_a_wrong_answer(
    db_dsn: str, pool: Any, tmp_path: Path
) -> None:
    (tmp_path / "bad_answers_app.py").write_text(BAD_ANSWERS_APP)
    await insert(pool, "none", "unknown", age=30)  # oldest first: the wrong answers come first
    await insert(pool, "conflict", "unknown", age=20)
    await insert(pool, "happened", "unknown", age=10)
    path = os.pathsep.join([str(tmp_path), str(ROOT)])
    result = cli(
        "reconcile", "--app", "bad_answers_app:app", "--json", dsn=db_dsn, env={"PYTHONPATH": path}
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["verdicts"] == {"failed": 2, "settled": 1}
    assert "Traceback" not in result.stderr
    assert "reconciler gave no usable answer: Happened(409)" in result.stderr
    assert "secret-body" not in result.stderr
    states = {r["idem_key"]: r["state"] for r in await pool.fetch("SELECT * FROM idem_requests")}
    assert states == {"none": "unknown", "conflict": "unknown", "happened": "succeeded"}


def test_a_value_error_inside_a_command_is_not_a_usage_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def broken(args: argparse.Namespace, handler: Any) -> int:
        raise ValueError("a bug, not a bad argument")

    monkeypatch.setattr(cli_commands, "with_store", broken)
    with pytest.raises(ValueError, match="a bug, not a bad argument"):
        cli_module.main(["--dsn", "postgresql://nobody@127.0.0.1:9/none", "stats"])


# -- numbers from the environment and the options -----------------------------------------------

ENV_NUMBERS = [
    ("IDEM_PURGE_BATCH_SIZE", ["purge"]),
    ("IDEM_PURGE_MAX_BATCHES", ["purge"]),
    ("IDEM_OUTBOX_MAX_ATTEMPTS", ["outbox", "publish", "--url", "http://127.0.0.1:9/", "--once"]),
]


def _parse(argv: list[str]) -> argparse.Namespace:
    return cli_module._parser().parse_args(["--dsn", "postgresql://x/y", *argv])


@pytest.mark.parametrize(("env", "command"), ENV_NUMBERS)
@pytest.mark.parametrize("value", ["many", "1.5", "0"])
def test_a_bad_number_in_the_environment_is_a_usage_error_naming_it(
    env: str,
    command: list[str],
    value: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(SystemExit) as exit_:
        _parse(command)
    assert exit_.value.code == 2
    assert f"{value!r} (from {env})" in capsys.readouterr().err


def test_help_and_other_commands_work_whatever_the_environment_holds() -> None:
    env = {name: "many" for name, _ in ENV_NUMBERS}
    for args in (("--help",), ("purge", "--help"), ("outbox", "publish", "--help")):
        shown = cli(*args, env=env)
        assert shown.returncode == 0, (args, shown.stderr)
    other = cli("stats", dsn="postgresql://nobody@127.0.0.1:9/none", env=env)
    assert other.returncode == 1  # the database, not the variables
    assert "Traceback" not in other.stderr
    purge = cli("purge", dsn="postgresql://nobody@127.0.0.1:9/none", env=env)
    assert purge.returncode == 2
    assert "'many' (from IDEM_PURGE_BATCH_SIZE) is not a whole number" in purge.stderr
    assert "Traceback" not in purge.stderr


def test_an_option_wins_over_a_bad_variable_and_good_variables_are_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("IDEM_PURGE_BATCH_SIZE", "many")
    monkeypatch.setenv("IDEM_PURGE_MAX_BATCHES", "7")
    monkeypatch.setenv("IDEM_OUTBOX_MAX_ATTEMPTS", " ")  # blank: the default
    args = _parse(["purge", "--batch-size", "3"])
    assert (args.batch_size, args.max_batches) == (3, 7)
    assert _parse(["outbox", "publish"]).max_attempts == 8


PUBLISH = ["outbox", "publish", "--url", "http://127.0.0.1:9/", "--once"]
RECONCILE = ["reconcile", "--app", "tests.cli_app:app"]


@pytest.mark.parametrize(
    ("argv", "option", "value"),
    [
        (command, option, value)
        for command, option in [
            (RECONCILE, "--seconds"),
            (PUBLISH, "--send-timeout"),
            (PUBLISH, "--idle-seconds"),
        ]
        for value in ("-1", "0", "nan", "inf", "-inf", "soon", "1e308")
    ]
    + [
        (PUBLISH, "--reservation-margin", value)
        for value in ("0", "-1", "nan", "inf", "soon", "1e308")
    ]
    + [
        (PUBLISH, "--max-attempts", "99999999999"),
        (PUBLISH, "--batch-size", "2147483648"),
        (["list"], "--limit", "99999999999999999999"),
    ],
)
def test_seconds_out_of_range_are_a_usage_error(
    argv: list[str], option: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        _parse([*argv, f"{option}={value}"])  # (with =, "-inf" is a value, not an option)
    assert exit_.value.code == 2
    assert f"error: argument {option}: {value!r}" in capsys.readouterr().err


def test_seconds_in_range_are_taken() -> None:
    assert _parse([*RECONCILE, "--seconds", "0.5"]).seconds == 0.5
    publish = _parse([*PUBLISH, "--reservation-margin", "0.1", "--idle-seconds", "0.01"])
    assert (publish.reservation_margin, publish.idle_seconds) == (0.1, 0.01)
    assert _parse(PUBLISH).send_timeout == 10.0


def test_a_blank_note_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("reopen", "resolve"):
        to = ("--to", "retry") if command == "resolve" else ()
        with pytest.raises(SystemExit) as exit_:
            _parse([command, *RECORD, "--key", "k", *to, "--note", " \n"])
        assert exit_.value.code == 2
        assert "an audit note is required" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["show", *RECORD, "--key", b"k\xff"], "--key"),
        (["list", "--operation", b"POST /\xfe"], "--operation"),
        (["list", "--tenant", b"\xff"], "--tenant"),
        (["reopen", *RECORD, "--key", "k", "--note", b"checked \xff"], "--note"),
        (["reconcile", "--app", "x:y", "--tenant", b"\xff"], "--tenant"),
    ],
)
def test_text_that_is_not_utf8_is_a_usage_error(argv: list[Any], option: str) -> None:
    """Bytes the shell passed that are not UTF-8 (Python reads them as lone surrogates) reached
    the driver: exit 1 with "invalid input for query argument $3: '\\udcff' ('utf-8' codec
    can't encode ...)" after connecting. Now the parser refuses them, naming the option."""
    command = [os.fsencode(sys.executable), b"-m", b"idem_middleware"]
    command += [b"--dsn", b"postgresql://nobody@127.0.0.1:9/none"]
    command += [os.fsencode(a) if isinstance(a, str) else a for a in argv]
    result = subprocess.run(command, capture_output=True, timeout=60)
    stderr = result.stderr.decode(errors="replace")
    assert result.returncode == 2, stderr
    assert f"argument {option}: " in stderr
    assert "is not UTF-8 text" in stderr
    assert "Traceback" not in stderr


async def test_a_store_outage_in_a_reconcilers_fence_is_not_the_reconcilers_failure(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by probing: a reconciler whose fenced connection could not be had (the database
    down) was counted as a failed reconciler: a client's retry was told `409 outcome-unknown`
    ("asking the downstream system failed"), and `reconcile` went on through every record. The
    store's failure is raised as every other one is: the retry gets `503`, and the record is
    left unknown for the next retry."""
    ours = RecordKey("tenant-a", "POST /payouts", "k")  # (the client's tenant)
    asked: list[str] = []

    async def ask_then_write(ctx: ReconcileContext) -> Reconciliation:
        asked.append(ctx.downstream_key)
        await ctx.fenced_connection()
        return Happened(201)

    async def lost(request: Request) -> JSONResponse:
        await request.body()
        return JSONResponse({}, status_code=502)  # lease mode: the outcome is unknown

    class Down:
        async def __aenter__(self) -> Any:
            raise StoreError("no database connection: ConnectionRefusedError")

        async def __aexit__(self, *exc: object) -> None:
            return None

    handler = idempotent(mode=Mode.LEASE, reconciler=ask_then_write)(lost)
    app = one_route_app("/payouts", handler, store=store)
    async with client(app) as c:
        assert (await c.post("/payouts", headers=HEADERS, json={})).status_code == 502
        record = await store.get(ours)
        assert record is not None
        monkeypatch.setattr(store, "fenced", lambda *args: Down())
        with pytest.raises(StoreError):
            await run_reconciler(store, ours, record.generation, ask_then_write, seconds=5)
        assert_problem(await c.post("/payouts", headers=HEADERS, json={}), 503, "store-unavailable")
    assert len(asked) == 2
    after = await store.get(ours)
    assert after is not None
    assert (after.state, after.generation) == (State.UNKNOWN, record.generation)

"""An operator cannot break a key: resolve validates what retries will get, re-resolving and
reopening keep an audit trail, on both stores and through the command line."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from idem_middleware.context import derive_downstream_key
from idem_middleware.ops import Resolution, ResolveError, operator_response, reopen, resolve
from idem_middleware.store import Claimed
from idem_middleware.store.base import RecordKey, Settlement, State, StoredResponse
from tests.contract import Harness
from tests.integration.test_cli import cli, insert

RECORD = ("--tenant", "t", "--operation", "POST /payouts")
KEY = RecordKey("t", "POST /payouts", "k")


async def _unknown_lease_record(harness: Harness) -> None:
    store = harness.store
    claim = await store.claim_lease(KEY, b"f", retention_seconds=60, lease_seconds=30)
    assert isinstance(claim, Claimed)
    assert await store.expire_lease(KEY, claim.generation) is False  # the lease still runs
    assert await store.settle(KEY, claim.generation, State.PENDING, Settlement(State.UNKNOWN))


@pytest.mark.parametrize(
    ("to", "status", "body", "content_type", "message"),
    [
        (Resolution.SUCCEEDED, 999, b"{}", "application/json", "not an HTTP status (100-599)"),
        (Resolution.SUCCEEDED, 99, b"", "application/json", "not an HTTP status"),
        (Resolution.SUCCEEDED, 201, b"{", "application/json", "not valid JSON"),
        (Resolution.SUCCEEDED, 201, b"[1,", "application/problem+json", "not valid JSON"),
        (Resolution.SUCCEEDED, 404, b"", "application/json", "2xx or 3xx"),
        (Resolution.SUCCEEDED, 101, b"", "application/json", "2xx or 3xx"),
        (Resolution.FAILED_FINAL, 200, b"", "application/json", "4xx"),
        (Resolution.FAILED_FINAL, 503, b"", "application/json", "a 5xx is not final"),
        (Resolution.FAILED_FINAL, 429, b"", "application/json", "429 tells the client to retry"),
        (Resolution.FAILED_FINAL, 408, b"", "application/json", "408 tells the client to retry"),
        (Resolution.FAILED_FINAL, 425, b"", "application/json", "425 tells the client to retry"),
        (Resolution.FAILED_FINAL, 401, b"", "application/json", "401 tells the client to retry"),
        (Resolution.SUCCEEDED, 204, b"{}", "application/json", "a 204 response has no body"),
        (Resolution.SUCCEEDED, 200, b"x", "text/plain\r\nset-cookie: a=b", "not a valid HTTP"),
        (Resolution.SUCCEEDED, 200, b"x", "json", "is not a media type"),
        (Resolution.SUCCEEDED, 200, b"x", "", "is not a media type"),
    ],
)
def test_a_response_that_would_break_the_key_is_refused(
    to: Resolution, status: int, body: bytes, content_type: str, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        operator_response(to, status, body, content_type)


def test_sound_responses_pass() -> None:
    ok = operator_response(Resolution.SUCCEEDED, 201, b'{"ok": true}', "application/json")
    assert ok.headers == [(b"content-type", b"application/json")]
    operator_response(Resolution.SUCCEEDED, 204)
    operator_response(Resolution.FAILED_FINAL, 402, b"no funds", "text/plain; charset=utf-8")
    operator_response(Resolution.FAILED_FINAL, 409, b"", "application/json")  # (a final conflict)
    operator_response(Resolution.SUCCEEDED, 303, b"", "application/json")


async def test_resolve_validates_a_response_given_directly(harness: Harness) -> None:
    await _unknown_lease_record(harness)
    with pytest.raises(ValueError, match="not an HTTP status"):
        await resolve(
            harness.store,
            KEY,
            Resolution.SUCCEEDED,
            note="n",
            response=StoredResponse(999, (), b""),
        )
    record = await harness.store.get(KEY)
    assert record is not None
    assert record.state is State.UNKNOWN


@pytest.mark.parametrize(
    ("response", "arguments", "error", "message"),
    [
        (StoredResponse(200, (), "{}"), {}, ValueError, "the body is bytes"),  # type: ignore[arg-type]
        (StoredResponse(200.5, (), b""), {}, ValueError, "the status is an int"),  # type: ignore[arg-type]
        (StoredResponse(True, (), b""), {}, ValueError, "the status is an int"),
        (StoredResponse(200, [("a", "b")], b""), {}, ValueError, "(bytes, bytes) pairs"),
        (StoredResponse(200, (), b""), {"again": "false"}, TypeError, "again is True or False"),
        (StoredResponse(200, (), b""), {"note": None}, TypeError, "an audit note is a str"),
        (StoredResponse(200, (), b""), {"note": b"n"}, TypeError, "an audit note is a str"),
    ],
)
async def test_resolve_checks_the_types_of_what_it_is_given(
    harness: Harness,
    response: StoredResponse,
    arguments: dict[str, Any],
    error: type[Exception],
    message: str,
) -> None:
    """Found by probing: a str body was stored (every replay then failed, a 500 for the whole
    retention; PostgreSQL refused it with asyncpg's own error), a status of 200.5 was stored as
    200 or replayed as 200.5, `again="false"` counted as true, and a note that was no str
    failed inside. Each is refused before the record is touched."""
    await _unknown_lease_record(harness)
    with pytest.raises(error, match=re.escape(message)):
        await resolve(
            harness.store,
            KEY,
            Resolution.SUCCEEDED,
            **{"note": "n", "response": response, **arguments},
        )
    record = await harness.store.get(KEY)
    assert record is not None
    assert record.state is State.UNKNOWN


def test_an_operator_response_refuses_a_str_body_and_a_content_type_that_is_no_str() -> None:
    with pytest.raises(ValueError, match="the body is bytes"):
        operator_response(Resolution.SUCCEEDED, 200, "{}")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="content_type is a str"):
        operator_response(Resolution.SUCCEEDED, 200, b"{}", None)  # type: ignore[arg-type]


async def test_re_resolve_and_reopen_keep_an_audit_trail(harness: Harness) -> None:
    store = harness.store
    await _unknown_lease_record(harness)
    created = StoredResponse(201, [(b"content-type", b"application/json")], b"{}")
    move = await resolve(store, KEY, Resolution.SUCCEEDED, note="bank shows it", response=created)
    assert (move.before, move.after, move.status) == (State.UNKNOWN, State.SUCCEEDED, 201)
    refused = StoredResponse(402, [], b"")
    with pytest.raises(ResolveError, match="pass --again"):
        await resolve(store, KEY, Resolution.FAILED_FINAL, note="x", response=refused)
    await resolve(
        store, KEY, Resolution.FAILED_FINAL, note="it bounced", response=refused, again=True
    )
    record = await store.get(KEY)
    assert record is not None
    assert (record.state, record.response) == (State.FAILED_FINAL, refused)
    await reopen(store, KEY, note="amount  was\nwrong")
    with pytest.raises(ResolveError, match="only succeeded or failed_final"):
        await reopen(store, KEY, note="again")
    before = await store.get(KEY)
    assert before is not None
    assert before.state is State.UNKNOWN
    await resolve(store, KEY, Resolution.RETRY, note="never sent")
    after = await store.get(KEY)
    assert after is not None
    assert after.retry_allowed
    assert after.generation > before.generation  # a late executor of the old one is fenced off
    summary = await store.describe(KEY)
    assert summary is not None
    trail = (summary.note or "").splitlines()
    assert [line.split(" ", 1)[1] for line in trail] == [
        "resolve unknown -> succeeded 201: bank shows it",
        "re-resolve succeeded 201 -> failed_final 402: it bounced",
        "reopen failed_final 402 -> unknown: amount was wrong",
        "resolve unknown -> pending: never sent",
    ]
    assert all(line[:20].endswith("Z") for line in trail)  # each line stamped, UTC
    with pytest.raises(ResolveError, match="released for the client's retry already"):
        await resolve(store, KEY, Resolution.RETRY, note="again")
    assert await store.describe(RecordKey("t", "POST /payouts", "absent")) is None
    with pytest.raises(ResolveError, match="no record holds this key"):
        await reopen(store, RecordKey("t", "POST /payouts", "absent"), note="n")


async def test_cli_refuses_a_broken_response_and_the_key_stays_unknown(
    db_dsn: str, pool: Any
) -> None:
    await insert(pool, "u1", "unknown")
    for extra in (
        ("--to", "succeeded", "--status", "999", "--body", "{"),
        ("--to", "succeeded", "--status", "201", "--body", "{"),
        ("--to", "failed_final", "--status", "200"),
        ("--to", "succeeded", "--status", "201", "--body", "x", "--content-type", "text"),
    ):
        result = cli("resolve", *RECORD, "--key", "u1", *extra, "--note", "n", dsn=db_dsn)
        assert result.returncode == 2, (extra, result.stdout)
        assert "error:" in result.stderr
        assert "resolved" not in result.stdout
    assert await pool.fetchval("SELECT state FROM idem_requests") == "unknown"


async def test_cli_says_no_business_write_was_made(db_dsn: str, pool: Any) -> None:
    await insert(pool, "u1", "unknown")
    ok = cli(
        "resolve",
        *RECORD,
        *("--key", "u1", "--to", "succeeded", "--status", "201", "--body", '{"ok": true}'),
        *("--note", "bank statement shows it"),
        dsn=db_dsn,
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("resolved: unknown -> succeeded (201)\nNo business write was made")


async def test_cli_re_resolves_reopens_and_shows_the_trail(db_dsn: str, pool: Any) -> None:
    await insert(pool, "s1", "succeeded", expires_at=datetime.now(UTC) + timedelta(hours=1))
    plain = cli(
        "resolve",
        *RECORD,
        "--key",
        "s1",
        "--to",
        "succeeded",
        "--status",
        "200",
        "--note",
        "x",
        dsn=db_dsn,
    )
    assert plain.returncode == 1
    assert "pass --again" in plain.stderr
    again = cli(
        "resolve",
        *RECORD,
        "--key",
        "s1",
        "--to",
        "succeeded",
        "--status",
        "200",
        "--again",
        "--note",
        "the amount was wrong",
        dsn=db_dsn,
    )
    assert again.returncode == 0, again.stderr
    reopened = cli("reopen", *RECORD, "--key", "s1", "--note", "ask the bank", "--json", dsn=db_dsn)
    assert json.loads(reopened.stdout)["after"] == "unknown"
    shown = cli("show", *RECORD, "--key", "s1", "--json", dsn=db_dsn)
    audit = json.loads(shown.stdout)["audit"]
    assert [line.split(" ", 1)[1] for line in audit] == [
        "re-resolve succeeded 201 -> succeeded 200: the amount was wrong",
        "reopen succeeded 200 -> unknown: ask the bank",
    ]
    human = cli("show", *RECORD, "--key", "s1", dsn=db_dsn)
    assert "audit trail" in human.stdout
    assert "reopen succeeded 200 -> unknown: ask the bank" in human.stdout
    listed = cli("list", "--state", "unknown", dsn=db_dsn)
    assert "re-resolve succeeded 201 -> succeeded 200" in listed.stdout
    assert " | " in listed.stdout  # the trail stays on the record's one line


async def test_a_transactional_record_is_not_released_for_a_retry(db_dsn: str, pool: Any) -> None:
    await pool.execute(
        "INSERT INTO idem_requests (tenant, operation, idem_key, fingerprint, state, mode, "
        "retention) VALUES ('t', 'POST /payouts', 'tx', '\\x00', 'unknown', 'transactional', "
        "interval '1 day')"
    )
    result = cli("resolve", *RECORD, "--key", "tx", "--to", "retry", "--note", "n", dsn=db_dsn)
    assert result.returncode == 1
    assert "transactional-mode record cannot be released" in result.stderr
    assert await pool.fetchval("SELECT state FROM idem_requests") == "unknown"


async def test_cli_refuses_a_response_with_to_retry(db_dsn: str, pool: Any) -> None:
    """`--to retry --status 201` released the record for a re-run and dropped the status without
    a word: the operator who meant "it happened, 201" got the handler run again."""
    await insert(pool, "u1", "unknown")
    for extra in (("--status", "201"), ("--body", "{}"), ("--content-type", "text/plain")):
        result = cli(
            "resolve", *RECORD, "--key", "u1", "--to", "retry", *extra, "--note", "n", dsn=db_dsn
        )
        assert result.returncode == 2, (extra, result.stdout)
        assert f"--to retry stores no response: {extra[0]} cannot go with it" in result.stderr
    assert await pool.fetchval("SELECT state FROM idem_requests") == "unknown"
    empty = cli(
        "resolve",
        *RECORD,
        *("--key", "u1", "--to", "succeeded", "--status", "200", "--body", "x"),
        *("--content-type", ""),
        *("--note", "n"),
        dsn=db_dsn,
    )
    assert empty.returncode == 2
    assert "is not a media type" in empty.stderr


async def test_show_names_the_records_epoch_and_its_downstream_key(
    db_dsn: str, pg_store: Any
) -> None:
    """An operator told to ask the downstream system about an unknown record could not: the
    key the execution sent there (its context's `downstream_key`) comes of the record's epoch,
    which no command showed."""
    key = RecordKey("t", "POST /payouts", "shown-epoch")
    claim = await pg_store.claim_lease(key, b"f", retention_seconds=60, lease_seconds=30)
    assert isinstance(claim, Claimed)
    shown = cli("show", *RECORD, "--key", key.key, "--json", dsn=db_dsn)
    assert shown.returncode == 0, shown.stderr
    record = json.loads(shown.stdout)
    assert record["epoch"] == claim.epoch
    assert record["downstream_key"] == derive_downstream_key(*key, claim.epoch)
    text = cli("show", *RECORD, "--key", key.key, dsn=db_dsn).stdout
    assert f"downstream_key  {record['downstream_key']}" in text

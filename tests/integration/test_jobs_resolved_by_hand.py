"""A job's record settled by hand (`idem-middleware resolve`, `ops.resolve`), as an operator
settles the `unknown` a lease-mode job leaves: every later call returns the stored body decoded
as JSON; an empty one returns None, and one that is not JSON raises an error that says how to
mend it, never the JSON decoder's own on every call (the key wedged until it expired)."""

from __future__ import annotations

from typing import Any

import pytest

from idem_middleware import IdempotencyContext, Mode
from idem_middleware.jobs import JobOutcomeUnknown, JobResultUnreadable, idempotent_job
from idem_middleware.ops import Resolution, operator_response, resolve
from idem_middleware.store.base import RecordKey, State
from idem_middleware.store.postgres import PostgresStore
from tests.integration.test_cli import cli

OPERATION = "payouts.send"
#: A key the error must not repeat (it may be sensitive: the operation names the job).
KEY = "acct-4417-secret"
RECORD = ("--tenant", "", "--operation", OPERATION, "--key", KEY)


def unknown_job(store: PostgresStore, runs: list[str]) -> Any:
    """A lease-mode job whose first run raises after its effect may have happened: `unknown`."""

    @idempotent_job(store, operation=OPERATION, key="k", mode=Mode.LEASE)
    async def job(ctx: IdempotencyContext, *, k: str) -> Any:
        runs.append(k)
        raise RuntimeError("downstream timed out")

    return job


async def left_unknown(store: PostgresStore, job: Any) -> None:
    with pytest.raises(RuntimeError, match="downstream timed out"):
        await job(k=KEY)
    with pytest.raises(JobOutcomeUnknown):
        await job(k=KEY)
    record = await store.get(RecordKey("", OPERATION, KEY))
    assert record is not None
    assert record.state is State.UNKNOWN


@pytest.mark.parametrize(
    ("response", "returned"),
    [
        (("--status", "204"), None),
        (("--status", "200"), None),  # no --body
        (("--status", "200", "--body", '{"paid": true}'), {"paid": True}),
        (("--status", "200", "--content-type", "text/plain", "--body", '"paid"'), "paid"),
    ],
    ids=["204", "200-no-body", "json", "json-string-as-text"],
)
async def test_a_job_resolved_by_hand_returns_its_body_decoded(
    pg_store: PostgresStore, db_dsn: str, response: tuple[str, ...], returned: Any
) -> None:
    runs: list[str] = []
    job = unknown_job(pg_store, runs)
    await left_unknown(pg_store, job)
    done = cli(
        "resolve", *RECORD, "--to", "succeeded", "--note", "bank says paid", *response, dsn=db_dsn
    )
    assert done.returncode == 0, done.stderr
    for _ in range(2):
        assert await job(k=KEY) == returned
    assert runs == [KEY]  # never run again


async def test_a_job_resolved_by_hand_with_text_says_how_to_mend_it(
    pg_store: PostgresStore, db_dsn: str
) -> None:
    """`--body paid` (not JSON) is stored as the operator asked, for any HTTP route it would
    be right for; the job cannot return it, and says so (a JobOutcomeUnknown: it waits for an
    operator as an unknown outcome does). Resolved again with JSON, the job returns that."""
    runs: list[str] = []
    job = unknown_job(pg_store, runs)
    await left_unknown(pg_store, job)
    text = ("--status", "200", "--content-type", "text/plain", "--body", "paid")
    done = cli("resolve", *RECORD, "--to", "succeeded", "--note", "paid", *text, dsn=db_dsn)
    assert done.returncode == 0, done.stderr
    for _ in range(2):
        with pytest.raises(JobResultUnreadable) as raised:
            await job(k=KEY)
        assert isinstance(raised.value, JobOutcomeUnknown)
        message = str(raised.value)
        assert message.startswith(f"{OPERATION}: ")
        assert "settled with a response the job cannot decode" in message
        assert "resolve --again --body '<json>'" in message
        assert KEY not in message
        assert raised.value.__cause__ is None
        assert raised.value.__suppress_context__
    mended = ("--status", "200", "--body", '{"paid": true}', "--again")
    done = cli("resolve", *RECORD, "--to", "succeeded", "--note", "json", *mended, dsn=db_dsn)
    assert done.returncode == 0, done.stderr
    assert await job(k=KEY) == {"paid": True}
    assert runs == [KEY]


async def test_a_transactional_jobs_record_resolved_again_with_text(
    pg_store: PostgresStore,
) -> None:
    """The same through `ops.resolve`, for a transactional job's settled record resolved anew
    (`again`): the error leaves the claim's transaction (rolled back, the record as it was)."""
    runs: list[str] = []

    @idempotent_job(pg_store, operation=OPERATION, key="k")
    async def job(ctx: IdempotencyContext, *, k: str) -> dict[str, int]:
        runs.append(k)
        return {"n": 1}

    assert await job(k=KEY) == {"n": 1}
    key = RecordKey("", OPERATION, KEY)
    text = operator_response(Resolution.SUCCEEDED, 200, b"paid", "text/plain")
    await resolve(pg_store, key, Resolution.SUCCEEDED, note="by hand", response=text, again=True)
    with pytest.raises(JobResultUnreadable, match="cannot decode"):
        await job(k=KEY)
    empty = operator_response(Resolution.FAILED_FINAL, 404)
    await resolve(pg_store, key, Resolution.FAILED_FINAL, note="none", response=empty, again=True)
    assert await job(k=KEY) is None
    record = await pg_store.get(key)
    assert record is not None
    assert record.state is State.FAILED_FINAL
    assert runs == [KEY]

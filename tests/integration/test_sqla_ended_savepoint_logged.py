"""A handler that ends the claim's transaction through its claim session and begins another
(`COMMIT` then `BEGIN`): the session's savepoint is gone at its end, and the session says so at
ERROR, naming the session as the way the transaction was ended (the store's own line names only
the connection). At DEBUG, an operator would not learn that the writes before the COMMIT
committed without their outcome."""

from __future__ import annotations

import logging
from typing import Any

import asyncpg
import pytest

from idem_middleware.store.postgres import PostgresStore
from tests.integration.test_sqla_handler_errors import _twice, store  # noqa: F401


@pytest.mark.parametrize("statement", ["commit-begin", "rollback-begin"])
async def test_a_savepoint_ended_under_the_session_is_logged_as_an_error(
    store: PostgresStore,  # noqa: F811
    pool: asyncpg.Pool[Any],
    statement: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="idem_middleware")
    await _twice(store, f"/ended/{statement}")  # (its outcome cannot be recorded either)
    said = [
        r
        for r in caplog.records
        if r.name == "idem_middleware" and "sent through its claim session" in r.getMessage()
    ]
    assert said, caplog.text
    assert {r.levelno for r in said} == {logging.ERROR}

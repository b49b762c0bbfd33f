"""A statement dropped under the session (26000) is asyncpg's or the store's when its name is:
run again once the connection's cache is emptied. A name the handler chose is its own error.
Told by the name alone, as servers translate the message and its quotes (lc_messages)."""

from __future__ import annotations

import asyncpg
import pytest
from sqlalchemy.exc import ProgrammingError

from idem_middleware.store.postgres.convert import is_conflict, stale_statement

DROPPED = asyncpg.exceptions.InvalidSQLStatementNameError


@pytest.mark.parametrize(
    "message",
    [
        'prepared statement "__asyncpg_stmt_3a__" does not exist',
        "vorbereitete Anweisung »__asyncpg_stmt_3__« existiert nicht",
        "l'instruction préparée « __asyncpg_stmt_1f__ » n'existe pas",
        "no existe la sentencia preparada «idem_claim_key_0123456789ab»",
    ],
)
def test_a_dropped_statement_of_asyncpgs_or_the_stores_is_run_again(message: str) -> None:
    error = DROPPED(message)
    assert stale_statement(error)
    assert is_conflict(error)
    wrapped = ProgrammingError("EXECUTE", None, error)  # (SQLAlchemy's, raised from it)
    wrapped.__cause__ = error
    assert is_conflict(wrapped)


@pytest.mark.parametrize(
    "message",
    [
        'prepared statement "never_prepared_by_anyone" does not exist',
        'prepared statement "idem_report" does not exist',
        "vorbereitete Anweisung »mein_plan« existiert nicht",
    ],
)
def test_a_name_the_handler_chose_is_its_own_error(message: str) -> None:
    error = DROPPED(message)
    assert not stale_statement(error)
    assert not is_conflict(error)

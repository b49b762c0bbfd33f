"""The example app answers 503 for its own database work in every case the store answers 503 for
its own: each driver error the store takes for the database being away (or unable to serve for
now) is one the example app's DATABASE_DOWN catches too. (A restart's FATAL "terminating
connection due to crash of another server process" reached the app's reads as a bare 500.)"""

from __future__ import annotations

import pytest

from example_app.app import DATABASE_DOWN
from idem_middleware.store.postgres.convert import CONNECTION_ERRORS, UNAVAILABLE


@pytest.mark.parametrize(
    "error", [*CONNECTION_ERRORS, *UNAVAILABLE], ids=lambda error: error.__name__
)
def test_the_example_app_takes_the_database_for_down_when_the_store_does(
    error: type[BaseException],
) -> None:
    assert issubclass(error, DATABASE_DOWN), (
        f"{error.__name__}: the store answers 503 for it, the example app's own routes a 500"
    )

"""A claim session's engine must be a claim engine: anything else writes outside the claim."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from idem_middleware.errors import ConfigurationError
from idem_middleware.sqla import ClaimSessions, create_claim_engine


async def test_an_engine_of_ones_own_is_refused() -> None:
    """Its sessions would commit for good even when the claim is released (and again on the
    retry): refused when the ClaimSessions is made, without showing the password."""
    engine = create_async_engine("postgresql+asyncpg://app:s3cret@db.example/app")
    try:
        with pytest.raises(ConfigurationError, match="create_claim_engine") as raised:
            ClaimSessions(engine=engine)
        assert "s3cret" not in str(raised.value)
    finally:
        await engine.dispose()


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"poolclass": NullPool}, "poolclass"),
        ({"creator": lambda: None}, "creator"),
        ({"isolation_level": "SERIALIZABLE"}, "isolation_level"),
        ({"connect_args": {"server_settings": {"application_name": "x"}}}, "connect_args"),
        # SQLAlchemy recycled a connection by opening one of its own: every request then failed.
        ({"pool_recycle": 3600}, "pool_recycle"),
        ({"pool_pre_ping": True}, "pool_pre_ping"),  # three round trips on a live connection
        # A savepoint takes no isolation level: AUTOCOMMIT skipped it (session.rollback() undid
        # nothing), SERIALIZABLE failed every statement, READ ONLY was dropped.
        ({"execution_options": {"isolation_level": "AUTOCOMMIT"}}, "isolation_level"),
        ({"execution_options": {"postgresql_readonly": True}}, "postgresql_readonly"),
    ],
    ids=[
        "poolclass",
        "creator",
        "isolation_level",
        "connect_args",
        "pool_recycle",
        "pool_pre_ping",
        "autocommit",
        "readonly",
    ],
)
def test_options_that_choose_the_connection_are_refused(
    options: dict[str, Any], named: str
) -> None:
    with pytest.raises(ConfigurationError, match=named):
        create_claim_engine(**options)


async def test_a_claim_engine_with_options_of_its_own_is_accepted() -> None:
    sessions = ClaimSessions(
        engine=create_claim_engine(echo=False, pool_pre_ping=False, pool_recycle=-1)
    )
    await sessions.engine.dispose()


@pytest.mark.parametrize(
    "options",
    [{"isolation_level": "AUTOCOMMIT"}, {"postgresql_readonly": True}],
    ids=["autocommit", "readonly"],
)
async def test_a_claim_engine_copied_with_a_characteristic_is_refused(
    options: dict[str, Any],
) -> None:
    """`engine.execution_options(...)`, a copy of a claim engine: accepted, it failed every
    request at run time (a plain 500, connections reported never returned)."""
    engine = create_claim_engine()
    try:
        with pytest.raises(ConfigurationError, match=next(iter(options))):
            ClaimSessions(engine=engine.execution_options(**options))
    finally:
        await engine.dispose()


def test_a_two_phase_session_is_refused() -> None:
    """It would prepare and commit the claim's own transaction at `session.commit()`: the
    handler's rows committed with no outcome recorded, and the retry ran it again."""
    with pytest.raises(ConfigurationError, match="twophase"):
        ClaimSessions(twophase=True)

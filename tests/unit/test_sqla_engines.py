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
    "options",
    [
        {"poolclass": NullPool},
        {"creator": lambda: None},
        {"isolation_level": "SERIALIZABLE"},
        {"connect_args": {"server_settings": {"application_name": "x"}}},
    ],
    ids=["poolclass", "creator", "isolation_level", "connect_args"],
)
def test_options_that_choose_the_connection_are_refused(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError, match=next(iter(options))):
        create_claim_engine(**options)


async def test_a_claim_engine_with_options_of_its_own_is_accepted() -> None:
    sessions = ClaimSessions(engine=create_claim_engine(echo=False, pool_pre_ping=False))
    await sessions.engine.dispose()

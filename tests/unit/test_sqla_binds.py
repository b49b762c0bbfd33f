"""A claim session writes on the claim's connection only: `binds` to an engine of one's own, or
a session class that picks engines itself (`get_bind`), would route its writes outside the claim
(committed even when the claim is released, and again by the retry)."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from idem_middleware.errors import ConfigurationError
from idem_middleware.sqla import ClaimSessions, create_claim_engine


class Base(DeclarativeBase):
    pass


class Row(Base):
    __tablename__ = "t_rows"
    id: Mapped[str] = mapped_column(primary_key=True)


class RoutingSession(Session):
    def get_bind(self, *args: Any, **kwargs: Any) -> Any:  # e.g. reads to a replica
        return super().get_bind(*args, **kwargs)


class RoutingAsyncSession(AsyncSession):
    sync_session_class = RoutingSession


async def test_binds_to_an_engine_of_ones_own_are_refused() -> None:
    own = create_async_engine("postgresql+asyncpg://app:s3cret@db.example/app")
    try:
        with pytest.raises(ConfigurationError, match=r"binds=.*create_claim_engine") as raised:
            ClaimSessions(binds={Row: own})
        assert "Row" in str(raised.value)
        assert "s3cret" not in str(raised.value)
        with pytest.raises(ConfigurationError, match="binds="):  # no engine at all
            ClaimSessions(binds={Base: object()})
    finally:
        await own.dispose()


def test_binds_to_claim_engines_are_accepted() -> None:
    engine = create_claim_engine()
    sessions = ClaimSessions(engine=engine, binds={Base: engine})
    assert sessions.factory.kw["binds"] == {Base: engine}


def test_bind_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="bind="):
        ClaimSessions(bind=create_claim_engine())


@pytest.mark.parametrize("how", ["session_class", "sync_session_class"])
def test_a_session_class_that_routes_is_refused(how: str) -> None:
    options: dict[str, Any] = (
        {"session_class": RoutingAsyncSession}
        if how == "session_class"
        else {"sync_session_class": RoutingSession}
    )
    with pytest.raises(ConfigurationError, match=r"RoutingSession.*get_bind"):
        ClaimSessions(**options)


def test_sqlmodel_sessions_are_accepted() -> None:
    from sqlmodel.ext.asyncio.session import AsyncSession as SQLModelSession

    ClaimSessions(session_class=SQLModelSession)

"""A FastAPI app written from docs/sqlalchemy.md with SQLModel table models and relationships,
on real PostgreSQL: what its ORM objects, its failing flush and its exception handlers get."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

import asyncpg
import httpx
import pytest
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from sqlmodel.ext.asyncio.session import AsyncSession

from idem_middleware.fastapi import install
from idem_middleware.sqla import ClaimSessions
from idem_middleware.store.postgres import PostgresStore
from tests.sqlmodel_models import Hero, HeroOut, Team, TeamIn, TeamOut

sessions = ClaimSessions(session_class=AsyncSession)
Session = Annotated[AsyncSession, Depends(sessions.dependency)]


class Declined(Exception):
    pass


@pytest.fixture
async def store(pool: asyncpg.Pool[Any]) -> AsyncIterator[PostgresStore]:
    await pool.execute(
        "CREATE TABLE IF NOT EXISTS test_sm_team (id serial PRIMARY KEY, name text NOT NULL "
        "UNIQUE); CREATE TABLE IF NOT EXISTS test_sm_hero (id serial PRIMARY KEY, name text NOT "
        "NULL, team_id int REFERENCES test_sm_team (id)); TRUNCATE test_sm_hero, test_sm_team"
    )
    async with PostgresStore(pool=pool) as store:
        yield store


def app_of(store: PostgresStore) -> FastAPI:
    app = FastAPI()

    @app.exception_handler(Declined)
    async def declined(request: Request, exc: Declined) -> JSONResponse:
        return JSONResponse({"declined": True}, status_code=402)  # stored: failed_final

    @app.post("/teams", status_code=201, response_model=TeamOut)
    async def create(body: TeamIn, session: Session) -> Team:
        team = Team(name=body.name, heroes=[Hero(name=h.name) for h in body.heroes])
        session.add(team)
        if body.name == "late":
            return team  # flushed by the dependency, after the response was built
        await session.flush()
        if body.name.startswith("declined"):
            if body.name == "declined-kept":
                await session.commit()
            raise Declined()
        return team  # built from the objects made here: nothing to load

    install(app, store=store, tenant_resolver=lambda scope: "t")
    return app


async def post(http: httpx.AsyncClient, key: str, body: dict[str, Any]) -> httpx.Response:
    return await http.post("/teams", json=body, headers={"Idempotency-Key": key})


async def names(pool: asyncpg.Pool[Any]) -> list[str]:
    rows = await pool.fetch("SELECT name FROM test_sm_team UNION ALL SELECT name FROM test_sm_hero")
    return sorted(r["name"] for r in rows)


async def test_relationships_in_the_response_model_commit_once_and_replay(
    store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    body = {"name": "avengers", "heroes": [{"name": "a"}, {"name": "b"}]}
    transport = httpx.ASGITransport(app=app_of(store))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        first = await post(http, "k", body)
        second = await post(http, "k", body)
    assert first.status_code == 201, first.text
    assert [HeroOut(**h).name for h in first.json()["heroes"]] == ["a", "b"]
    assert second.headers.get("idempotent-replayed") == "true"
    assert second.content == first.content
    assert await names(pool) == ["a", "avengers", "b"]


async def test_a_duplicate_found_by_the_dependencys_flush_is_a_500_that_frees_the_key(
    store: PostgresStore, pool: asyncpg.Pool[Any]
) -> None:
    await pool.execute("INSERT INTO test_sm_team (name) VALUES ('late')")
    transport = httpx.ASGITransport(app=app_of(store), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        response = await post(http, "late", {"name": "late", "heroes": [{"name": "x"}]})
    assert response.status_code == 500  # not the 201 the handler had returned
    assert await names(pool) == ["late"]
    assert await pool.fetch("SELECT 1 FROM idem_requests") == []


@pytest.mark.parametrize(("name", "kept"), [("declined", []), ("declined-kept", ["declined-kept"])])
async def test_an_exception_the_app_turns_into_a_stored_status_rolls_the_session_back(
    store: PostgresStore, pool: asyncpg.Pool[Any], name: str, kept: list[str]
) -> None:
    """The 402 is stored and replayed; the session's writes since its last commit() are not."""
    transport = httpx.ASGITransport(app=app_of(store))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        first = await post(http, name, {"name": name})
        second = await post(http, name, {"name": name})
    assert (first.status_code, second.status_code) == (402, 402)
    assert second.headers.get("idempotent-replayed") == "true"
    assert await names(pool) == kept

"""SQLModel table models for tests/integration/test_sqla_sqlmodel.py. A module of their own, without
`from __future__ import annotations`: SQLModel reads `list["Hero"]` at class creation."""

from sqlmodel import Field, Relationship, SQLModel


class Team(SQLModel, table=True):
    __tablename__ = "test_sm_team"
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(unique=True)
    heroes: list["Hero"] = Relationship(back_populates="team")


class Hero(SQLModel, table=True):
    __tablename__ = "test_sm_hero"
    id: int | None = Field(default=None, primary_key=True)
    name: str
    team_id: int | None = Field(default=None, foreign_key="test_sm_team.id")
    team: Team | None = Relationship(back_populates="heroes")


class HeroIn(SQLModel):
    name: str


class TeamIn(SQLModel):
    name: str
    heroes: list[HeroIn] = []


class HeroOut(SQLModel):
    id: int
    name: str


class TeamOut(SQLModel):
    id: int
    name: str
    heroes: list[HeroOut]

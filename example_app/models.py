"""The example app's request and response bodies, and the problem documents it sends."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Path
from pydantic import BaseModel, Field, field_validator

# What the tables can keep: PostgreSQL text holds no NUL, a key of the accounts' index must stay
# well under its 2,704-byte limit, and amounts and balances are bigint. Anything else is a 422,
# not a 500 from the database (which, for a payout, would leave its outcome unknown).
NO_NUL = r"^[^\x00]*$"
MAX_ACCOUNT_ID = 255
MAX_AMOUNT = 2**63 - 1
AccountPath = Annotated[str, Path(min_length=1, max_length=MAX_ACCOUNT_ID, pattern=NO_NUL)]


class Amount(BaseModel):
    amount: int = Field(gt=0, le=MAX_AMOUNT)

    @field_validator("amount", mode="before")
    @classmethod
    def _json_integer(cls, value: Any) -> Any:
        # Not `true` for 1 nor `"5"` for 5: an amount of money is a JSON number.
        if isinstance(value, bool | str):
            raise ValueError("the amount must be a JSON integer")
        return value


class CreditIn(Amount):
    memo: str | None = Field(default=None, pattern=NO_NUL)


class CreditOut(BaseModel):
    credit_id: str
    account_id: str
    amount: int
    balance: int


class PayoutIn(Amount):
    account_id: str = Field(min_length=1, max_length=MAX_ACCOUNT_ID, pattern=NO_NUL)


class PayoutOut(BaseModel):
    payout_id: str
    account_id: str
    amount: int
    balance: int
    bank_transfer_id: str


class Problem(BaseModel):
    """The RFC 9457 shape of the app's own errors."""

    type: str
    title: str
    status: int


def problems(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """Document the app's own error responses, so the OpenAPI schema matches what it sends: only
    application/problem+json (a `model` would be documented as the route's application/json)."""
    schema = Problem.model_json_schema()
    documented: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        documented[status] = {"content": {"application/problem+json": {"schema": schema}}}
        if status == 503:  # (the database is away: see `account`)
            documented[status]["headers"] = {"Retry-After": {"schema": {"type": "integer"}}}
    return documented


class AccountOut(BaseModel):
    account_id: str
    balance: int
    credits: int

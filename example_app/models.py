"""The example app's request and response bodies, and the problem documents it sends."""

from __future__ import annotations

from collections.abc import Mapping
from http import HTTPStatus
from typing import Annotated, Any

from fastapi import Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, field_validator
from starlette.exceptions import HTTPException
from starlette.responses import Response

from idem_middleware.errors import ProblemKind
from idem_middleware.responses import problem_response

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
        # Not `true` for 1, `"5"` for 5 nor `5.0` for 5: an amount of money is a JSON integer
        # (`9007199254740993.0` read as a float is 9007199254740992: another amount).
        if isinstance(value, bool | str | float):
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
    detail: str | None = None


class FieldError(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ValidationProblem(Problem):
    """A 422: from the request's validation, what is wrong field by field (`errors`); from the
    handler (a balance past the largest kept), a problem without them."""

    errors: list[FieldError] = Field(default_factory=list)


def _inlined(schema: Any, defs: dict[str, Any] | None = None) -> Any:
    """A model's JSON schema with its `$defs` written in place: a `#/$defs/...` reference would
    point at the root of the OpenAPI document, which has none."""
    if defs is None and isinstance(schema, dict):
        defs = schema.get("$defs", {})
    if isinstance(schema, dict):
        ref = schema.get("$ref", "")
        if ref.startswith("#/$defs/"):
            return _inlined(defs[ref.removeprefix("#/$defs/")] if defs else {}, defs)
        return {k: _inlined(v, defs) for k, v in schema.items() if k != "$defs"}
    if isinstance(schema, list):
        return [_inlined(v, defs) for v in schema]
    return schema


def problems(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """Document the app's own error responses, so the OpenAPI schema matches what it sends: only
    application/problem+json (a `model` would be documented as the route's application/json)."""
    documented: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        model = ValidationProblem if status == 422 else Problem
        schema = _inlined(model.model_json_schema())
        documented[status] = {"content": {"application/problem+json": {"schema": schema}}}
        if status == 503:  # (the database is away: see `account`)
            documented[status]["headers"] = {"Retry-After": {"schema": {"type": "integer"}}}
    return documented


class AccountOut(BaseModel):
    account_id: str
    balance: int
    credits: int


#: The types of the app's own kinds of problem: a client tells them apart by `type`, as it does
#: the middleware's (RFC 9457; `about:blank` is for a problem that says no more than its status).
APP_PROBLEMS = "urn:idem-example:problem:"


def problem(
    status: int, detail: str, kind: str | None = None, headers: Mapping[str, str] | None = None
) -> Response:
    """A problem document: of the app's own `kind` (its type, and a title of its own), or
    `about:blank` with the status's phrase as its title; `detail` says what happened. A 401 is
    the middleware's own `unauthenticated` problem, as the library builds it: one type for one
    problem, whichever answers it (`headers`' WWW-Authenticate its challenge)."""
    if status == 401:
        challenge = (headers or {}).get("WWW-Authenticate")
        return problem_response(
            ProblemKind.UNAUTHENTICATED,
            detail,
            challenge=None if challenge is None else challenge.encode("latin-1"),
        )
    if kind is None:
        kind_type, title = "about:blank", HTTPStatus(status).phrase
    else:
        kind_type, title = APP_PROBLEMS + kind, kind.replace("-", " ").capitalize()
    return JSONResponse(
        {"type": kind_type, "title": title, "status": status, "detail": detail},
        status_code=status,
        media_type="application/problem+json",
        headers=headers,
    )


def http_problem(request: Request, exc: Exception) -> Response:
    """An HTTPException (the app's own, or the router's 404 and 405) as a problem document."""
    assert isinstance(exc, HTTPException)
    return problem(exc.status_code, exc.detail, headers=exc.headers)


def validation_problem(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's validation error as a 422 problem document. Each error names where it is, what
    is wrong and its kind; the value the client sent is not echoed back (it may be personal)."""
    assert isinstance(exc, RequestValidationError)
    errors = [
        {"loc": list(error["loc"]), "msg": error["msg"], "type": error["type"]}
        for error in exc.errors()
    ]
    return JSONResponse(
        {
            "type": "about:blank",
            "title": HTTPStatus(422).phrase,
            "status": 422,
            "detail": "the request is not valid",
            "errors": errors,
        },
        status_code=422,
        media_type="application/problem+json",
    )

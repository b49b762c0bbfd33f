"""A handler's status given as an `http.HTTPStatus` member (`HTTPException(HTTPStatus.NOT_FOUND)`,
`JSONResponse(..., status_code=HTTPStatus.CREATED)`, FastAPI's injected `response.status_code`)
is the int it is: every server sends it as its number. Found by probing: the capture took only a
plain `int`, so each was refused as "not a final HTTP status", a bare 500 that ran the handler
again at every retry, and in lease mode left its key `unknown` after the effect had run."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, HTTPException, Response
from fastapi.responses import JSONResponse, RedirectResponse

from idem_middleware import MemoryStore, Mode, idempotent
from idem_middleware.fastapi import install
from idem_middleware.responses import send_replay
from idem_middleware.sendable import UnsendableResponse, final_status
from idem_middleware.store import StoredResponse
from idem_middleware.store.base import new_record_key


def _app(store: MemoryStore, mode: Mode, runs: list[str]) -> FastAPI:
    app = FastAPI()
    guarded = idempotent(mode=mode)

    @app.post("/missing")
    @guarded
    async def missing() -> None:
        runs.append("missing")
        raise HTTPException(status_code=HTTPStatus.NOT_FOUND, detail="no such account")

    @app.post("/created")
    @guarded
    async def created() -> JSONResponse:
        runs.append("created")
        return JSONResponse({"id": 1}, status_code=HTTPStatus.CREATED)

    @app.post("/accepted")
    @guarded
    async def accepted(response: Response) -> dict[str, bool]:
        runs.append("accepted")
        response.status_code = HTTPStatus.ACCEPTED
        return {"queued": True}

    @app.post("/redirect")
    @guarded
    async def redirect() -> RedirectResponse:
        runs.append("redirect")
        return RedirectResponse("/orders/1", status_code=HTTPStatus.SEE_OTHER)

    install(app, store=store, tenant_resolver=lambda scope: "t")
    return app


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
@pytest.mark.parametrize(
    ("path", "status", "runs_after_two"),
    [("/missing", 404, 2), ("/created", 201, 1), ("/accepted", 202, 1), ("/redirect", 303, 1)],
)
async def test_a_status_given_as_an_http_status_member_is_recorded_as_its_number(
    mode: Mode, path: str, status: int, runs_after_two: int
) -> None:
    store = MemoryStore()
    runs: list[str] = []
    transport = httpx.ASGITransport(app=_app(store, mode, runs))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        answers = [
            await client.post(path, json={}, headers={"Idempotency-Key": "k1"}) for _ in range(2)
        ]
    assert [answer.status_code for answer in answers] == [status, status]
    assert len(runs) == runs_after_two  # a 404 releases the key: run again; the rest replay
    if runs_after_two == 1:
        assert answers[1].headers["idempotent-replayed"] == "true"
        record = await store.get(new_record_key(("t", f"POST {path}", "k1")))
        assert record is not None
        assert record.response is not None
        assert type(record.response.status) is int
        assert record.response.status == status


async def test_a_replay_hook_may_answer_with_an_http_status_member() -> None:
    stored = StoredResponse(201, [(b"content-type", b"text/plain")], b"paid")
    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    def hook(response: StoredResponse, scope: Any) -> StoredResponse:
        return StoredResponse(HTTPStatus.OK, list(response.headers), b"paid, and seen")

    await send_replay(send, stored, hook, {"type": "http"}, "POST /pay")
    assert type(sent[0]["status"]) is int
    assert sent[0]["status"] == 200
    assert sent[1]["body"] == b"paid, and seen"


@pytest.mark.parametrize("status", [True, 201.0, "201", HTTPStatus.CONTINUE, 600, None])
def test_final_status_refuses_what_is_no_final_status(status: Any) -> None:
    with pytest.raises(UnsendableResponse, match="not a final HTTP status"):
        final_status(status)

"""Form and multipart bodies on guarded FastAPI and Starlette routes, in both modes, on
PostgreSQL: a retry under a new multipart boundary or with its form fields reordered is replayed,
a body read differently is `422 key-reused`, the framework's own 400 for a form it refuses
releases the key, and an upload spooled to disk reads as in the bare app."""

from __future__ import annotations

from typing import Annotated, Any

import httpx
import pytest
from fastapi import BackgroundTasks, FastAPI, File, Form, UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse

from idem_middleware import Mode, Policy
from idem_middleware.fastapi import install
from tests.apps import assert_problem, records

pytest.importorskip("python_multipart")

MODES = [
    pytest.param(Policy(max_body_bytes=4 << 20), id="transactional"),
    pytest.param(
        Policy(mode=Mode.LEASE, lease_seconds=5.0, wait_seconds=0.3, max_body_bytes=4 << 20),
        id="lease",
    ),
]
SPOOLED = bytes(range(256)) * 8192  # 2 MiB: over Starlette's 1 MiB, so the upload is on disk


def _app(store: Any, policy: Policy) -> FastAPI:
    app = FastAPI()
    app.state.calls = 0
    app.state.read_later: list[int] = []

    @app.post("/orders", status_code=201)
    async def order(
        amount: Annotated[int, Form()], tags: Annotated[list[str], Form()]
    ) -> dict[str, Any]:
        app.state.calls += 1
        return {"amount": amount, "tags": tags, "call": app.state.calls}

    @app.post("/documents", status_code=201)
    async def document(
        doc: Annotated[UploadFile, File()], later: BackgroundTasks, label: Annotated[str, Form()]
    ) -> dict[str, Any]:
        app.state.calls += 1
        data = await doc.read()

        async def read_again() -> None:  # after the response, as the bare app allows
            await doc.seek(0)
            app.state.read_later.append(len(await doc.read()))

        later.add_task(read_again)
        on_disk = getattr(doc.file, "_rolled", None)
        name, kind = doc.filename, doc.content_type
        return {"size": len(data), "name": name, "type": kind, "label": label, "disk": on_disk}

    @app.post("/one-file", status_code=201)
    async def one_file(request: Request) -> JSONResponse:
        async with request.form(max_files=1) as form:
            app.state.calls += 1
            return JSONResponse({"fields": sorted(form), "call": app.state.calls}, 201)

    install(app, store=store, tenant_resolver=lambda scope: "t", default_policy=policy)
    return app


def _client(app: FastAPI) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://test")


def _key(value: str) -> dict[str, str]:
    return {"Idempotency-Key": value}


@pytest.mark.parametrize("policy", MODES)
async def test_a_form_is_replayed_with_its_fields_reordered_but_not_with_repeats_reordered(
    pg_store, pool, policy: Policy
) -> None:
    app = _app(pg_store, policy)
    async with _client(app) as c:
        first = await c.post("/orders", content=b"amount=5&tags=a&tags=b", headers=_form("k1"))
        again = await c.post("/orders", content=b"tags=a&tags=b&amount=5", headers=_form("k1"))
        swapped = await c.post("/orders", content=b"amount=5&tags=b&tags=a", headers=_form("k1"))
        spaced = await c.post("/orders", content=b"amount=5&tags=a+b", headers=_form("k2"))
        encoded = await c.post("/orders", content=b"amount=5&tags=a%20b", headers=_form("k2"))
    assert first.status_code == 201
    assert first.json()["tags"] == ["a", "b"]
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json()
    assert_problem(swapped, 422, "key-reused")  # the handler reads ["b", "a"]
    # "+" and "%20" read alike, but a retry sends the same bytes: stricter, never wrong.
    assert spaced.status_code == 201
    assert_problem(encoded, 422, "key-reused")
    assert app.state.calls == 2


def _form(key: str) -> dict[str, str]:
    return {"content-type": "application/x-www-form-urlencoded", **_key(key)}


@pytest.mark.parametrize("policy", MODES)
async def test_an_upload_retried_under_a_new_boundary_is_replayed_and_a_changed_one_is_not(
    pg_store, pool, policy: Policy
) -> None:
    """httpx draws a new boundary for every request, as browsers and most clients do. The
    upload is spooled to disk and read again after the response, as in the bare app."""
    app = _app(pg_store, policy)
    upload = {"doc": ("a.bin", SPOOLED, "application/octet-stream")}
    async with _client(app) as c:
        first = await c.post("/documents", files=upload, data={"label": "x"}, headers=_key("k"))
        again = await c.post("/documents", files=upload, data={"label": "x"}, headers=_key("k"))
        changed = [
            await c.post("/documents", files=files, data={"label": "x"}, headers=_key("k"))
            for files in (
                {"doc": ("a.bin", SPOOLED[:-1] + b"!", "application/octet-stream")},
                {"doc": ("b.bin", SPOOLED, "application/octet-stream")},
                {"doc": ("a.bin", SPOOLED, "text/plain")},
            )
        ]
    assert first.status_code == 201, first.text
    assert first.json() == {
        "size": len(SPOOLED),
        "name": "a.bin",
        "type": "application/octet-stream",
        "label": "x",
        "disk": True,
    }
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json()
    for response in changed:  # content, file name, part type: each read differently
        assert_problem(response, 422, "key-reused")
    assert app.state.calls == 1
    assert app.state.read_later == [len(SPOOLED)]


@pytest.mark.parametrize("policy", MODES)
async def test_a_form_the_framework_refuses_with_400_after_the_claim_releases_the_key(
    pg_store, pool, policy: Policy
) -> None:
    """Starlette's own form limits (here `max_files=1`) are met inside the handler, after the
    claim: its 400 is "nothing happened, fix and retry", so the key is free for the fix."""
    app = _app(pg_store, policy)
    two = {"a": ("a", b"1"), "b": ("b", b"2")}
    async with _client(app) as c:
        refused = await c.post("/one-file", files=two, headers=_key("k"))
        assert await records(pool) == []
        fixed = await c.post("/one-file", files={"a": ("a", b"1")}, headers=_key("k"))
    assert refused.status_code == 400
    assert refused.json() == {"detail": "Too many files. Maximum number of files is 1."}
    assert fixed.status_code == 201
    assert fixed.json() == {"fields": ["a"], "call": 1}


@pytest.mark.parametrize("policy", MODES)
@pytest.mark.parametrize(
    "content_type",
    [
        b"multipart/form-data; boundary=",
        b'multipart/form-data; boundary=""',
        b"multipart/form-data",
    ],
)
async def test_a_multipart_body_without_a_usable_boundary_is_the_frameworks_400_and_no_record(
    pg_store, pool, policy: Policy, content_type: bytes
) -> None:
    app = _app(pg_store, policy)
    body = b'--X\r\nContent-Disposition: form-data; name="a"\r\n\r\n1\r\n--X--\r\n'
    async with _client(app) as c:
        headers = {"content-type": content_type.decode(), **_key("k")}
        r = await c.post("/one-file", content=body, headers=headers)
    assert r.status_code == 400
    assert await records(pool) == []

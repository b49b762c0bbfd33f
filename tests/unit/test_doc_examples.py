"""The Python blocks of docs/*.md: every one compiles and imports only what the package has; the
three knobs' examples (docs/configuration-knobs.md) run, and answer what the page says they do,
in the words it quotes. (The README's apps and those of fastapi.md and starlette.md run in
tests/integration/test_readme_examples.py; testing.md's in test_pytest_plugin.py; the other
pages' fragments, their blanks filled, on PostgreSQL in tests/integration/test_doc_fragments.py.)"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, MemoryStore, Policy
from idem_middleware.endpoints import endpoint_policy

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").glob("*.md"))
KNOBS = ROOT / "docs" / "configuration-knobs.md"


def blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.DOTALL)


def under(heading: str, page: Path = KNOBS) -> str:
    """The first Python block under a `## ` heading of the page."""
    section = page.read_text().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    found = blocks_of(section)
    assert found, f"no python block under {heading!r}"
    return found[0]


def blocks_of(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.DOTALL)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_block_compiles_and_imports_what_the_package_has(page: Path) -> None:
    missing = []
    for block in blocks(page):
        # Fragments may await at the top level ("in the handler: await add(...)").
        tree = compile(block, page.name, "exec", ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                module = importlib.import_module(node.module)
                missing += [
                    f"{node.module}.{alias.name}"
                    for alias in node.names
                    if not hasattr(module, alias.name)
                ]
    assert not missing


def run(block: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "doc_example"}
    exec(compile(block, str(KNOBS), "exec"), namespace)
    return namespace


def client(routes: list[Route], **options: Any) -> httpx.AsyncClient:
    app = Starlette(routes=routes)
    mw = IdempotencyMiddleware(
        app, store=MemoryStore(), tenant_resolver=lambda scope: "t", **options
    )
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=mw), base_url="http://t")


def quoted(heading: str) -> list[str]:
    """The answers a section of the page quotes, in its words ("The ... .")."""
    section = KNOBS.read_text().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r'"(The [^"]+\.)"', " ".join(section.split()))


async def test_the_key_source_examples_answer_in_the_words_the_page_quotes() -> None:
    heading = "`key_source`: where the key comes from"
    names = run(under(heading))
    routes = [
        Route("/orders", names["create_order"], methods=["POST"]),
        Route("/stripe", names["stripe_webhook"], methods=["POST"]),
        Route("/shopify", names["shopify_webhook"], methods=["POST"]),
    ]
    async with client(routes) as http:
        bad_header = await http.post("/orders", json={}, headers={"x-request-id": "x" * 256})
        not_a_key = await http.post("/stripe", json={"event": {"id": True}})
        no_key = await http.post("/stripe", json={"event": {}})
        no_shopify_id = await http.post("/shopify", json={})
    details = [r.json()["detail"] for r in (bad_header, not_a_key, no_key)]
    assert [bad_header.status_code, not_a_key.status_code, no_key.status_code] == [400, 400, 400]
    assert sorted(details) == sorted(quoted(heading))
    # `where` names the source in the missing-key detail.
    assert no_shopify_id.json()["detail"].endswith("from the X-Shopify-Webhook-Id header.")


async def echo(request: Request) -> JSONResponse:
    return JSONResponse({"got": await request.json()})


async def test_the_include_fields_example_counts_only_the_named_members() -> None:
    policy = endpoint_policy(
        run(under("`include_fields`: what the fingerprint covers"))["create_payout"]
    )
    assert policy is not None
    route = Route("/payouts", echo, methods=["POST"])
    async with client([route], policies={"POST /payouts": policy}) as http:

        async def post(body: dict[str, Any]) -> httpx.Response:
            return await http.post("/payouts", json=body, headers={"idempotency-key": "p-1"})

        first = await post({"amount": 5, "memo": "a"})
        outside = await post({"amount": 5, "memo": "b"})  # differs outside the allowlist
        null = await post({"amount": 5, "currency": None})  # "Missing is not null"
    assert first.status_code == 200
    assert outside.headers["idempotent-replayed"] == "true"
    assert outside.json() == first.json()
    assert null.status_code == 422


async def test_the_replay_hook_example_marks_replays_only() -> None:
    mark_replay = run(under("`replay_hook`: what a replay looks like"))["mark_replay"]
    route = Route("/things", echo, methods=["POST"])
    policy = Policy(replay_hook=mark_replay)
    async with client([route], policies={"POST /things": policy}) as http:
        first = await http.post("/things", json={"n": 1}, headers={"idempotency-key": "h-1"})
        again = await http.post("/things", json={"n": 1}, headers={"idempotency-key": "h-1"})
    assert "x-cache" not in first.headers
    assert again.headers["x-cache"] == "replay"
    assert again.headers["idempotent-replayed"] == "true"

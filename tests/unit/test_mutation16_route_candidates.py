"""Mutants of route_candidates.py's latest change killed: a route whose regex was compiled with
other flags than Starlette's is never filed by its path (a multi-line one set by hand
takes `/pay%0Ax` too), a Mount is filed by its path (its regex ends in `/{path:path}`), the
candidates of a method that is not kept still leave out the routes of other methods, and the
lists of HTTP's own methods do not use up the few made-up methods kept."""

from __future__ import annotations

import re
from typing import Any

from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route, Router

from idem_middleware.route_candidates import _KEPT_METHOD_LENGTH, _METHODS, Memo, candidates


async def endpoint(request: Any) -> PlainTextResponse:
    return PlainTextResponse("ok")


def http(path: str, method: str = "POST") -> dict[str, Any]:
    return {"type": "http", "method": method, "path": path, "root_path": "", "headers": []}


def test_a_route_whose_regex_has_other_flags_is_asked_for_every_path() -> None:
    """`re.MULTILINE` on Starlette's own pattern: its `$` matches before any newline, so the
    router sends `POST /pay%0Ax` to it; filed under "pay", it was no candidate for that path,
    and the request ran unguarded."""
    pay = Route("/pay", endpoint, methods=["POST"])
    pay.path_regex = re.compile(pay.path_regex.pattern, re.MULTILINE)
    other = Route("/other", endpoint, methods=["POST"])
    routes = [other, pay]
    assert pay.matches(http("/pay\nx"))[0].name == "FULL"
    assert pay in candidates(routes, http("/pay\nx"), Memo())
    assert list(candidates(routes, http("/other"), Memo())) == [other, pay]


def test_a_mount_is_filed_by_its_path() -> None:
    api = Mount("/api", app=Router([Route("/pay", endpoint, methods=["POST"])]))
    other = Route("/other", endpoint, methods=["POST"])
    routes = [api, other]
    assert list(candidates(routes, http("/other"), Memo())) == [other]
    assert list(candidates(routes, http("/api/pay"), Memo())) == [api]


def test_a_method_not_kept_leaves_out_the_routes_of_other_methods() -> None:
    posted = Route("/pay", endpoint, methods=["POST"])
    any_method = Route("/pay", Router())  # (an ASGI app: every method)
    routes = [posted, any_method]
    long = "X" * (_KEPT_METHOD_LENGTH + 1)
    memo = Memo()
    assert list(candidates(routes, http("/pay", long), memo)) == [any_method]
    assert not memo.candidates  # (not kept)
    assert list(candidates(routes, http("/pay", "POST"), memo)) == [posted, any_method]


def test_the_lists_of_http_methods_do_not_use_up_the_made_up_ones_kept() -> None:
    memo = Memo()
    lists = [
        [Route(f"/a{i}", endpoint, methods=["POST"]), Route(f"/b{i}", endpoint, methods=["GET"])]
        for i in range(_METHODS + 8)
    ]
    for routes in lists:
        for method in ("GET", "POST"):
            candidates(routes, http("/a0", method), memo)
    routes = lists[0]
    candidates(routes, http("/a0", "PURGE"), memo)
    assert (id(routes), "PURGE") in memo.candidates
    assert memo.made_up == 1

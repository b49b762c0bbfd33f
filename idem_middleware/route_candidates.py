"""Which of a list of routes can match a request FULL, found once per list and method: the
routes the middleware asks, in the router's order (`routing.match_route`), when its route cache
does not have the request's path."""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

from starlette.routing import BaseRoute, Match, compile_path
from starlette.types import Scope

from .body_limits import LimitMemo
from .middleware_arguments import HTTP_METHODS
from .route_classes import API_MATCHES, API_ROUTE, PLAIN_MATCHES, SEGMENTED, learn_fastapi

try:
    from starlette._utils import get_route_path as _route_path
except ImportError:  # pragma: no cover - a Starlette without it: every candidate is asked
    _route_path = None  # type: ignore[assignment]


def route_path(scope: Scope) -> str:
    """The request's path within its root path, as Starlette's routes match it."""
    path: str = scope.get("path", "")
    return path if _route_path is None else _route_path(scope)


#: Entries kept in each memo (lists made and dropped at run time: then it starts over).
_SIZE = 1024
#: Methods an included router's routes are kept filed by: HTTP's own, and the first others up
#: to 32 in all (any token is a method to a server: one memo per method a client made up grew
#: without bound).
_METHODS = 32
_MAX_DEPTH = 32
#: The longest method outside HTTP's own whose candidates are kept (see `_made_up_kept`).
_KEPT_METHOD_LENGTH = 32
#: The route paths whose compiled regexes `_compiles_to` remembers (the app's own: not a client's).
_COMPILED_SIZE = 16384


class Memo:
    """What the misses of one middleware's route cache work out once: per list of routes and
    method, the trie of the routes a request can match; per included router, its route lists
    and tries. Kept by the middleware, so that it goes with its app (kept here, for every app,
    it kept every app made at run time alive)."""

    __slots__ = ("candidates", "included", "limits", "made_up")

    def __init__(self) -> None:
        #: `body_limits.declared_limit` per route, mount, router and app asked.
        self.limits: LimitMemo = {}
        #: Per list of routes and method: the list and its length then, its trie, and the
        #: route lists of the FastAPI routers included in it with their lengths then (the trie
        #: files each router by what its routes' paths share: see `_filed_prefix`).
        self.candidates: dict[tuple[int, str], _Candidates] = {}
        #: Per included router: the router, the route lists of its router and of the routers
        #: it includes and their lengths then (a route added to one, or a router included,
        #: changes one), and per method the trie of its routes that take the method.
        self.included: dict[
            int, tuple[Any, tuple[Any, ...], tuple[int, ...], dict[str, _Trie]]
        ] = {}
        #: How many of `candidates` are for methods outside HTTP's own (at most `_METHODS`).
        self.made_up = 0


def _prefix(route: BaseRoute) -> tuple[str, ...]:
    """The literal segments every path `route` can match starts with (`/accounts/{id}/pay` and
    the mount `/accounts`: ("accounts",)); () when its regex cannot be seen to require any (a
    parameter in the first segment, a custom route class, a regex of another shape)."""
    if type(route).matches not in SEGMENTED:
        return ()
    return _literal_prefix(getattr(route, "path", None), getattr(route, "path_regex", None))


def _literal_prefix(path: Any, regex: Any) -> tuple[str, ...]:
    if not isinstance(path, str) or not isinstance(regex, re.Pattern) or regex.flags & re.I:
        return ()
    if not path.startswith("/"):
        return ()
    segments: list[str] = []
    for part in path[1:].split("/"):
        if "{" in part:
            break
        segments.append(part)
    literal = "/" + "/".join(segments)
    # Starlette compiles the text before the first parameter with `re.escape`: a pattern that
    # starts with `literal` and a `/`, or is `literal` alone, matches only paths that start with
    # those segments.
    pattern = regex.pattern
    if not (
        pattern.startswith("^" + re.escape(literal + "/")) or pattern == f"^{re.escape(literal)}$"
    ):
        return ()
    # ... provided the regex is the one Starlette compiles from the path (a route's, or a mount's
    # with its `/{path:path}` tail): one set by hand may start so and still take other paths
    # (`^/accounts/(?P<id>[^/]+)$|^/legacy/...`), and is asked for every path.
    return tuple(segments) if _compiled_from(path, regex) else ()


def _compiled_from(path: str, regex: re.Pattern[str]) -> bool:
    return _compiles_to(path, regex.pattern, regex.flags)


@functools.lru_cache(maxsize=_COMPILED_SIZE)
def _compiles_to(path: str, pattern: str, flags: int) -> bool:
    """Whether Starlette compiles `path` (a route's, or a mount's) to `pattern`: asked once per
    path. (Compiled again for each list and method, a large app's routes missed `re`'s cache of
    512: filing 5,000 routes took 0.4 s, at every request of a method whose candidates are not
    kept, any token a client makes up.)"""
    for source in (path, path + "/{path:path}"):
        try:
            compiled = compile_path(source)[0]
        except Exception:  # (a path Starlette would not compile: not one of its regexes)
            return False
        if compiled.pattern == pattern and compiled.flags == flags:
            return True
    return False


#: What the routes a request can match FULL are, by its path's segments: a node's routes (every
#: route whose literal segments lead to it or to a node above it, in order), and its children by
#: the next segment.
_Trie = tuple[dict[str, "_Trie"], tuple[Any, ...]]


#: A list's entry in `Memo.candidates` (see there).
_Candidates = tuple[Sequence[BaseRoute], int, "_Trie", tuple[Any, ...], tuple[int, ...]]


def candidates(
    routes: Sequence[BaseRoute], scope: Scope, memo: Memo | None = None
) -> Sequence[BaseRoute]:
    """`routes` less those that cannot match the request FULL: routes of a class that matches
    as Starlette's `Route` does (`PLAIN_MATCHES`) whose `methods` exclude its method, and
    routes whose paths start with other literal segments than the request's (`_prefix`: a large
    app's routes are not all asked, once for every new path; a FastAPI included router by what
    all of its routes' paths start with). Worked out once per list and method (again if the
    list's length changes, or that of a route list of a router included in it); under FastAPI's
    included routers (a "fastapi" entry in the scope, which can make an `APIRoute` match as its
    included copy) every route is asked."""
    return candidates_and_filed(routes, scope, memo)[0]


def candidates_and_filed(
    routes: Sequence[BaseRoute], scope: Scope, memo: Memo | None = None
) -> tuple[Sequence[BaseRoute], tuple[Any, ...]]:
    """`candidates`, and the route lists of the FastAPI routers included in `routes` that were
    filed by their routes' paths (some of them may not be among the candidates): a route added
    to one may match the request next time, so a match made without asking them holds only
    while their lengths do (`route_cache.Trace`)."""
    learn_fastapi()
    method = scope.get("method")
    if len(routes) < 2 or not isinstance(method, str) or "fastapi" in scope:
        return routes, ()
    entry = _entry(routes, method, memo or Memo())
    return _walk(entry[2], scope), entry[3]


def _entry(routes: Sequence[BaseRoute], method: str, memo: Memo) -> _Candidates:
    cache_key = (id(routes), method)
    cached = memo.candidates.get(cache_key)
    if (
        cached is None
        or cached[0] is not routes
        or cached[1] != len(routes)
        or (cached[3] and tuple(map(len, cached[3])) != cached[4])
    ):
        if method not in HTTP_METHODS and not _made_up_kept(memo, cache_key):
            # Not kept: worked out again at every request, by the method alone (filing the
            # routes by their paths cost a large app's worker 20 times its router's own work).
            plain = tuple(route for route in routes if not _other_method(route, method))
            return routes, len(routes), ({}, plain), (), ()
        lists: list[Any] = []
        filed: dict[int, tuple[str, ...]] = {}
        for route in routes:
            if not _other_method(route, method):
                prefix = _filed_prefix(route, memo, lists)
                if prefix is not None:
                    filed[id(route)] = prefix
        kept = tuple(route for route in routes if id(route) in filed)
        trie = _trie(kept, lambda route: filed[id(route)])
        filed_by = tuple(lists)
        cached = (routes, len(routes), trie, filed_by, tuple(map(len, filed_by)))
        if len(memo.candidates) >= _SIZE:
            memo.candidates.clear()  # lists made and dropped at run time: start over
            memo.made_up = 0
        memo.made_up += method not in HTTP_METHODS and cache_key not in memo.candidates
        memo.candidates[cache_key] = cached
    return cached


def _made_up_kept(memo: Memo, cache_key: tuple[int, str]) -> bool:
    """Whether the candidates for a method outside HTTP's own are kept: a short one, among the
    first `_METHODS` (any token is a method to a server: uvicorn's h11 takes one of 60 KB, and
    1,024 of them, kept, held 60 MB for good; many short ones started the memo over, and every
    request after worked its candidates out again)."""
    method = cache_key[1]
    if len(method) > _KEPT_METHOD_LENGTH:
        return False
    return memo.made_up < _METHODS or cache_key in memo.candidates


def _filed_prefix(route: Any, memo: Memo, lists: list[Any]) -> tuple[str, ...] | None:
    """`_prefix` of a route; of a FastAPI included router, the literal segments the paths of all
    of its routes (those of the routers it includes too) start with: it matches FULL exactly
    when one of them does (`routing.match_route`); None for one with no route, which matches
    nothing. Its route lists go to `lists`."""
    contexts_of = getattr(route, "effective_route_contexts", None)
    entry = _included(route, memo) if callable(contexts_of) else None
    if entry is None:
        return _prefix(route)
    lists.extend(entry[1])
    prefixes = [_context_prefix(context) for context in contexts_of()]  # type: ignore[misc]
    if not prefixes:
        return None
    # What all share is what the first and the last in order share (tuples sort by segment).
    first, last = min(prefixes), max(prefixes)
    shared = 0
    for one, other in zip(first, last, strict=False):
        if one != other:
            break
        shared += 1
    return first[:shared]


def _walk(trie: _Trie, scope: Scope) -> tuple[Any, ...]:
    """The routes of the deepest node the request's path reaches. (Every node holds the routes
    of no literal segment: a path not starting with `/`, which no other route can match, finds
    them whatever its "segments".) A path's one final newline (`%0A`, decoded by the server) is
    no part of its last segment: a route's regex ends in `$`, which matches before it, so the
    router serves `/pay\n` as `/pay`, and filed under "pay\n" it ran unguarded."""
    node = trie
    if not node[0] or _route_path is None:
        return node[1]  # (no route has a literal segment: every one is at the root)
    path = _route_path(scope)
    if path.endswith("\n"):  # (Starlette's `...$` matches `/pay\n` as `/pay`: see `re`'s `$`)
        path = path[:-1]
    start = 1
    for _ in range(_MAX_DEPTH):
        end = path.find("/", start)
        child = node[0].get(path[start:] if end < 0 else path[start:end])
        if child is None:
            break
        node = child
        if end < 0 or not node[0]:
            break
        start = end + 1
    return node[1]


def _other_method(route: Any, method: str) -> bool:
    """A route of a class that matches as Starlette's `Route` does, whose `methods` exclude
    `method`: it answers PARTIAL at best."""
    methods = getattr(route, "methods", None)
    if not methods:
        return False
    return method not in methods and type(route).matches in PLAIN_MATCHES


def _trie(kept: tuple[Any, ...], prefix: Any) -> _Trie:
    """`kept`'s trie by the literal segments (`prefix` of each) their paths start with (at most
    `_MAX_DEPTH` of them)."""
    if _route_path is None:  # pragma: no cover - no path to walk by: every route at the root
        return {}, kept
    own: dict[tuple[str, ...], list[int]] = {(): []}
    for index, route in enumerate(kept):
        segments = prefix(route)[:_MAX_DEPTH]
        for depth in range(len(segments)):
            own.setdefault(segments[:depth], [])
        own.setdefault(segments, []).append(index)
    below: dict[tuple[str, ...], list[tuple[str, ...]]] = {}
    for node in own:
        if node:
            below.setdefault(node[:-1], []).append(node)

    def build(node: tuple[str, ...], above: list[int]) -> _Trie:
        indexes = sorted(above + own[node])
        children = {child[-1]: build(child, indexes) for child in below.get(node, ())}
        return children, tuple(kept[i] for i in indexes)

    return build((), [])


# -- FastAPI's included routers ------------------------------------------------------------------


def router_lists(route: Any, memo: Memo | None = None) -> tuple[Any, ...] | None:
    """The route lists (`routes`) of a FastAPI included router's router and of the routers it
    includes, found again only when one of them changed length; None for any other route, and
    for an included router that looks otherwise than FastAPI's do."""
    entry = _included(route, memo or Memo())
    return None if entry is None else entry[1]


def _included(
    route: Any, memo: Memo
) -> tuple[Any, tuple[Any, ...], tuple[int, ...], dict[str, _Trie]] | None:
    if getattr(route, "original_router", None) is None:
        return None
    entry = memo.included.get(id(route))
    if entry is not None and entry[0] is route and tuple(map(len, entry[1])) == entry[2]:
        return entry
    found: list[Any] = []
    if not _lists(route, found, 0):
        return None
    if len(memo.included) >= _SIZE:
        memo.included.clear()
    lists = tuple(found)
    entry = memo.included[id(route)] = (route, lists, tuple(map(len, lists)), {})
    return entry


def _lists(route: Any, out: list[Any], depth: int) -> bool:
    routes = getattr(getattr(route, "original_router", None), "routes", None)
    if routes is None or depth >= _MAX_DEPTH:
        return False
    if not any(seen is routes for seen in out):
        out.append(routes)
        for inner in routes:
            if hasattr(inner, "original_router") and not _lists(inner, out, depth + 1):
                return False
    return True


def included_candidates(route: Any, scope: Scope, memo: Memo | None = None) -> Sequence[Any] | None:
    """For FastAPI's included router (newer FastAPI keeps one as a single route): its routes,
    those of the routers it includes too, each as it matches under the router, in the order
    FastAPI asks them, less those that cannot match the request FULL (as `candidates`). None
    for any other route."""
    learn_fastapi()
    contexts_of = getattr(route, "effective_route_contexts", None)
    if not callable(contexts_of) or (entry := _included(route, memo or Memo())) is None:
        return None
    method = scope.get("method")
    if not isinstance(method, str) or "fastapi" in scope:
        return tuple(contexts_of())
    by_method = entry[3]
    trie = by_method.get(method)
    if trie is None:
        plain = tuple(c for c in contexts_of() if not _other_method_context(c, method))
        if method not in HTTP_METHODS and (  # (any token is a method: few and short ones kept)
            len(method) > _KEPT_METHOD_LENGTH or len(by_method) >= _METHODS
        ):
            return plain  # (not kept: not filed by path either, see `_entry`)
        trie = by_method[method] = _trie(plain, _context_prefix)
    return _walk(trie, scope)


def _api_context(context: Any) -> bool:
    """A context FastAPI matches by its own path regex and methods (an `APIRoute`'s)."""
    if type(context).__name__ != "_EffectiveRouteContext":
        return False
    original = getattr(context, "original_route", None)
    return original is not None and type(original).matches in API_MATCHES


def _other_method_context(context: Any, method: str) -> bool:
    if _api_context(context):
        methods = context.methods
        return bool(methods) and method not in methods
    starlette_route = getattr(context, "starlette_route", None)
    return starlette_route is not None and _other_method(starlette_route, method)


def _context_prefix(context: Any) -> tuple[str, ...]:
    if _api_context(context):
        return _literal_prefix(context.path, context.path_regex)
    starlette_route = getattr(context, "starlette_route", None)
    return () if starlette_route is None else _prefix(starlette_route)


def own_matches(context: Any) -> bool:
    """An included `APIRoute` of a class with its own `matches` (a version header, say): FastAPI
    asks that, not the context's path regex alone."""
    learn_fastapi()
    original: Any = getattr(context, "original_route", None)
    return (
        bool(API_ROUTE)
        and isinstance(original, API_ROUTE[0])
        and type(original).matches not in API_MATCHES
        and getattr(context, "starlette_route", None) is None
    )


def ask_as_fastapi(context: Any, scope: Scope, trace: Any) -> tuple[Match, Scope]:
    """`context`'s route asked as FastAPI's included router asks it (its `matches`, with the
    context in the scope's "fastapi" entry), on a copy of the scope; the answer may depend on
    more than the route cache's key (`trace`, a `route_cache.Trace`: volatile)."""
    if trace is not None:
        trace.volatile = True
    fastapi_scope = {**scope.get("fastapi", {}), "effective_route_context": context}
    answer: tuple[Match, Scope] = context.original_route.matches(
        {**scope, "fastapi": fastapi_scope}
    )
    return answer

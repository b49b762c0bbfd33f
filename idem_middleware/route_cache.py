"""The middleware's route cache: what a resolution depended on (`Trace`), and the entries that
keep it (per app, method, root path, path and Host) while it holds. A route list added to or
removed from at run time, or replaced (`app.router.routes = [...]`), resolves the paths under it
again; a match that asked a route whose `matches` may read more than the cache's key (a custom
route class: a version header, say) is not kept at all."""

from __future__ import annotations

import operator
from collections.abc import Hashable, Sequence
from typing import Any, cast

from .fingerprint import Fingerprinter
from .policy import Policy
from .route_candidates import Memo, router_lists
from .route_classes import PURE_MATCHES, learn_fastapi

#: Resolved routes kept per (app, method, root path, path, host): a request to a path seen
#: before skips the route walk. Cleared when full (paths with ids in them are all distinct).
ROUTE_CACHE_SIZE = 1024

#: The longest method, root path, path and Host header, together, whose resolution is kept: ids
#: in paths are short, and a server takes paths of 64 KB (uvicorn with httptools): cached, 1,024
#: of them, each kept twice (the key, the fingerprinter's parameters), held 130 MB of a worker for
#: good. (Any token is a method to a server: long ones were kept too.)
CACHED_KEY_LENGTH = 1024

#: The most paths met once that `Seen` remembers (a number each) before it starts over.
SEEN_SIZE = 4 * ROUTE_CACHE_SIZE

#: A guarded path as the cache keeps it: its requests' fingerprinter (the path's parameters in
#: it), its policy, its operation's name and its body limit (body_limits).
Guarded = tuple[Fingerprinter, Policy, str, int | None]
#: The cache's entry for a request the middleware passes on (compared by identity).
UNGUARDED = cast(Guarded, ())
#: The entry for a request whose own method or path names an operation no record can hold.
UNNAMEABLE = cast(Guarded, (None,))


class Trace:
    """What a match depended on, for the route cache: the route lists it walked and what holds
    them (the match holds while each is its holder's and keeps its length: a route added or
    removed, or a list replaced, at run time resolves the paths under it again), the defaults of
    the routers it fell through, and whether it asked a route whose answer may change with more
    than the cache's key (`volatile`: the match is not cached)."""

    __slots__ = ("_walked", "defaults", "memo", "volatile")

    def __init__(self, memo: Memo | None = None) -> None:
        #: Per router none of whose routes matched: the router and its `default` then (one set
        #: or replaced later may take the request: `defaults_unchanged`).
        self.defaults: dict[int, tuple[Any, Any]] = {}
        #: The lists walked, by identity (each is alive while the trace is: ids stay unique),
        #: each with what holds it (see `walked`).
        self._walked: dict[int, tuple[Any, Sequence[Any]]] = {}
        self.volatile = False
        #: What the walk works out once (the middleware's: see route_candidates.Memo).
        self.memo = memo

    @property
    def lists(self) -> tuple[Sequence[Any], ...]:
        """The route lists walked, in the order first walked."""
        return tuple(routes for _, routes in self._walked.values())

    @property
    def holders(self) -> tuple[Any, ...]:
        """What holds each of `lists` as its `routes`: a list replaced by another
        (`app.router.routes = [...]`) is not the holder's any more."""
        return tuple(holder for holder, _ in self._walked.values())

    def walked(self, routes: Sequence[Any], router: Any = None) -> None:
        """`routes` walked: `router`'s own (a Router), or one whose holder is not known (an
        included router's lists: seen by their lengths alone)."""
        if id(routes) not in self._walked:
            self._walked[id(routes)] = (Listed(routes) if router is None else router, routes)

    def fell_through(self, router: Any) -> None:
        """No route of `router` matched: the request goes to its `default` (see `defaults`)."""
        self.defaults.setdefault(id(router), (router, getattr(router, "default", None)))

    def asked(self, route: Any) -> None:
        learn_fastapi()
        if type(route).matches not in PURE_MATCHES:
            self.volatile = True
        elif hasattr(route, "original_router"):
            self.included(route)  # matched or not: a route added to it may match next time

    def included(self, route: Any) -> None:
        """An included FastAPI router's lists: its router's and those of routers it includes."""
        lists = router_lists(route, self.memo)
        if lists is None:
            self.volatile = True  # a FastAPI whose included routers look otherwise
            return
        for routes in lists:
            self.walked(routes)


class Untraced(Trace):
    """A Trace that keeps nothing but the memo: a path met for the first time is resolved and
    not kept (`Seen`), so what its match depended on is not worth noting. One per middleware,
    shared by its requests (a resolution runs to its end without awaiting): nothing is read of
    it but `memo`."""

    __slots__ = ()

    def __init__(self, memo: Memo) -> None:
        self.memo = memo
        self.volatile = False

    def walked(self, routes: Sequence[Any], router: Any = None) -> None:
        pass

    def fell_through(self, router: Any) -> None:
        pass

    def asked(self, route: Any) -> None:
        pass


class Seen:
    """The cache keys resolved once, by their hashes: the route cache keeps a path from its
    second request on. Most paths with an id in them are met once, and an entry for each cost
    more than finding its route again (the entry made, and the collector's passes over the
    entries held: docs/performance-history.md). A set of numbers, which the collector does not pass
    over, cleared when it holds `SEEN_SIZE`."""

    __slots__ = ("_hashes",)

    def __init__(self) -> None:
        self._hashes: set[int] = set()

    def again(self, key: Hashable) -> bool:
        """Whether `key` was met before (or another with its hash: kept at once, as before);
        remembered if not."""
        hashes, mark = self._hashes, hash(key)
        if mark in hashes:
            return True
        if len(hashes) >= SEEN_SIZE:
            hashes.clear()
        hashes.add(mark)
        return False


class Listed:
    """A route list's holder where no router is known to hold it: the list itself, for good."""

    __slots__ = ("routes",)

    def __init__(self, routes: Sequence[Any]) -> None:
        self.routes = routes


#: The routers a resolution fell through (no route matched), each with its `default` then.
_Defaults = tuple[tuple[Any, Any], ...]
#: The holders of the route lists a resolution walked besides the first, the lists, and their
#: lengths then.
_Others = tuple[tuple[Any, ...], tuple[Any, ...], tuple[int, ...]]
#: A route cache entry: the resolution; the first route list walked, what holds it (its Router,
#: see `Trace.walked`) and its length then; the others', or None (no other: one list is checked
#: at a fraction of the cost); the defaults of the routers it fell through, or None. A list
#: replaced by another, or of another length, or a default set, resolves the path again (the
#: middleware checks the first list inline: `unchanged` and `defaults_unchanged` the rest).
Entry = tuple[Guarded, Any, Sequence[Any], int, _Others | None, _Defaults | None]
_ROUTES = operator.attrgetter("routes")
#: The holder of the empty route list of an app whose routes cannot be seen.
_NO_ROUTES = Listed(())


def entry(guarded: Guarded, trace: Trace) -> Entry:
    """The cache's entry for `guarded`, resolved as `trace` saw it."""
    holder, *holders = trace.holders or (_NO_ROUTES,)
    first, *others = trace.lists or (_NO_ROUTES.routes,)
    rest = (tuple(holders), tuple(others), tuple(map(len, others))) if others else None
    return guarded, holder, first, len(first), rest, tuple(trace.defaults.values()) or None


def defaults_unchanged(defaults: _Defaults) -> bool:
    """The routers a cached resolution fell through have the `default` they had (a default app
    set or replaced since may serve the path: found again)."""
    return all(getattr(router, "default", None) is default for router, default in defaults)


def unchanged(others: _Others) -> bool:
    """The route lists a cached resolution walked besides the first are their holders' still
    (the very lists: one replaced by an equal list, whose routes compare by path, endpoint and
    methods, may differ in what it wraps), and of the same lengths."""
    holders, lists, lengths = others
    held = tuple(map(id, map(_ROUTES, holders)))  # (the lists are alive: their ids are theirs)
    return held == tuple(map(id, lists)) and tuple(map(len, lists)) == lengths

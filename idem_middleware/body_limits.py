"""The request-body limits Starlette (1.10+) and FastAPI (0.165+) let an app declare per route,
mount or router (`max_body_size`), and how a guarded request follows them.

The middleware reads the whole body before the router runs (to fingerprint it), so a limit
enforced further in would act too late: after the claim (a route's lower limit: a claim, then
the app's 413) or too early (a route's higher limit than the app's: the app's limit, still in
force while the middleware reads, refuses a body the route accepts). So the limits on the way
to the route are read when the route is matched (cached with the match; docs/configuration.md,
"Request body limits"). Under an app-level limiter outside the middleware, which counts what the
middleware reads, every limiter below refuses a body already read past its own (Starlette's
limiter lets an inner limit replace the enclosing ones only while nothing has been read), so the
least of them is the limit in force, and:

- it caps the guarded body, in place of a `max_body_bytes` left at its default, or when lower
  than the policy's own: a body over it is the middleware's `413 body-too-large`, before any
  claim; a policy that sets a lower `max_body_bytes` of its own keeps it;
- an app-level limit outside the middleware that is below it is raised to it while the
  middleware reads, as the route would raise it;
- the startup check warns when a guarded route accepts more than that.

With no app-level limiter outside the middleware, the first limiter below counts what the app
reads, and the innermost limit is in force, as in the bare app (`in_force`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeGuard

from starlette.routing import Router
from starlette.types import Scope

from .policy import DEFAULT_MAX_BODY_BYTES, Policy

if TYPE_CHECKING:
    from .route_candidates import Memo

#: The limiter Starlette's `RequestBodyLimitMiddleware` leaves in the scope while it counts the
#: body (a private key: when a Starlette renames it, an app-level limit stays in force while the
#: middleware reads, and a body over it is Starlette's 413, before any claim, as before).
_RESPONDER_KEY = "starlette._body_limit_responder"
_MAX_WRAPPERS = 32
#: Starlette's `MAX_BODY_SIZE_SCOPE_KEY`: a limiter outside the middleware is counting the body.
_LIMIT_KEY = "starlette.max_body_size"


def _is_count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


try:
    from starlette.middleware.body_limit import RequestBodyLimitMiddleware as _Limiter
except ImportError:  # pragma: no cover - a Starlette before 1.10 has no limits
    _Limiter = None  # type: ignore[assignment,misc]

#: A memo of `declared_limit` per object asked (a route, mount, router or app, made once and
#: asked at each miss of the middleware's route cache), each answer with its object (ids are
#: reused). The middleware keeps one (`route_candidates.Memo`), which goes with its app.
LimitMemo = dict[int, tuple[Any, int | None]]
_MEMO_SIZE = 1024


def declared_limit(obj: Any, memo: LimitMemo | None = None) -> int | None:
    """The body limit a route, mount, router or mounted app declares: FastAPI's routes,
    included routes and apps keep theirs as `max_body_size` (with their routers' and app's
    folded in); Starlette's routes and mounts wrap their app in a `RequestBodyLimitMiddleware`,
    its routers their middleware stack. None: no limit declared there. (Worked out once per
    object with a `memo`: they are made with the app and never change after its first
    request.)"""
    if memo is None:
        return _declared(obj)
    cached = memo.get(id(obj))
    if cached is not None and cached[0] is obj:
        return cached[1]
    limit = _declared(obj)
    if len(memo) >= _MEMO_SIZE:
        memo.clear()  # objects made and dropped at run time: start over
    memo[id(obj)] = (obj, limit)
    return limit


def _declared(obj: Any) -> int | None:
    limit = getattr(obj, "max_body_size", None)
    if _is_count(limit):
        return limit
    if _Limiter is None:  # pragma: no cover
        return None
    inner = obj.middleware_stack if isinstance(obj, Router) else getattr(obj, "app", None)
    for _ in range(_MAX_WRAPPERS):
        if inner is None or isinstance(inner, Router):
            return None
        if isinstance(inner, _Limiter):
            return inner.max_body_size if _is_count(inner.max_body_size) else None
        inner = getattr(inner, "app", None)
    return None


def capped(policy: Policy, limit: int | None) -> Policy:
    """`policy` with the route's body limit as its `max_body_bytes` where that applies (see the
    module's docstring)."""
    if limit is None or limit == policy.max_body_bytes:
        return policy
    if policy.max_body_bytes == DEFAULT_MAX_BODY_BYTES or limit < policy.max_body_bytes:
        return replace(policy, max_body_bytes=limit)
    return policy


def in_force(scope: Scope, innermost: int | None, least: int | None) -> int | None:
    """The limit a guarded request's body meets once the middleware has read it: with an
    app-level limiter outside the middleware counting it (Starlette's app, FastAPI's), each
    limiter below checks the bytes counted so far, so the least of them; with none, the first
    limiter below counts what the app reads, under the innermost limit, as in the bare app."""
    return least if _LIMIT_KEY in scope else innermost


def follow_route_limit(scope: Scope, limit: int) -> None:
    """Raise an enclosing app-level limit below the route's to the route's, as the route does
    when the router reaches it (never lowers one: a body over the route's limit is refused by
    the middleware's cap first)."""
    responder = scope.get(_RESPONDER_KEY)
    current = getattr(responder, "max_body_size", None)
    if _is_count(current) and current < limit:
        responder.max_body_size = limit  # type: ignore[union-attr]


def limit_warning(
    operation: str, policy: Policy, declared: int | None, enforced: int | None
) -> str | None:
    """The startup warning for a guarded route that accepts larger bodies (`declared`, its own
    `max_body_size`) than a guarded request to it can send (`enforced`: the least limit on the
    way, see `tighter`; the policy's `max_body_bytes`)."""
    if declared is None:
        return None
    cap = capped(policy, enforced).max_body_bytes
    if cap >= declared:
        return None
    if enforced is not None and enforced < declared and cap == enforced:
        fix = (
            f"an enclosing router's or the app's max_body_size={enforced} refuses them once the "
            f"middleware has read the body (before the route could raise it): raise that limit "
            f"and lower the other routes' own instead"
        )
    else:
        fix = (
            f"its policy's max_body_bytes={policy.max_body_bytes} refuses them: raise "
            f"max_body_bytes to {declared}, or leave it at its default to follow the route"
        )
    return (
        f"{operation} accepts request bodies up to {declared} bytes (its max_body_size), but "
        f"guarded requests over {cap} get 413: {fix}"
    )


def mounted_limit(app: Any, own: bool = True, memo: Memo | None = None) -> int | None:
    """The limits of what a Mount or Host dispatches to: a Router's, or a mounted Starlette or
    FastAPI app's (`own`: its app-level `max_body_size`, besides its router's), behind any
    middleware. (`memo`: see route_candidates.Memo.)"""
    for _ in range(_MAX_WRAPPERS):
        if app is None:
            return None
        if isinstance(app, Router):
            return _limit_of(app, memo)
        router = getattr(app, "router", None)
        if isinstance(router, Router):
            return tighter(_limit_of(router, memo), _limit_of(app, memo) if own else None)
        app = getattr(app, "app", None)
    return None


def _limit_of(obj: Any, memo: Memo | None) -> int | None:
    return declared_limit(obj, None if memo is None else memo.limits)


def tighter(limit: int | None, outer: int | None) -> int | None:
    """The body limit a request the middleware has read meets on its way to the route: each
    limiter it passes refuses a body already read past its own, so the least of them (a bare
    app's innermost limit replaces the enclosing ones, but they check before any byte is read)."""
    if limit is None:
        return outer
    return limit if outer is None else min(limit, outer)

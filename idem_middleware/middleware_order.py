"""The order of the app's own middleware around IdempotencyMiddleware, read at startup from the
app's middleware list: what must run before it (authentication), what makes wrong replays
when it runs after it (compression, CORS, a redirect, a request ID), and whether one before it
may answer a request it cancels (a timeout); and the middleware declared on the way to a guarded
route (a Route's, Mount's or Router's `middleware=[...]`, a mounted app's own), which runs inside
it. Only warned, but for authentication: a middleware added otherwise cannot be seen, and
another may do the same work under its own name."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from starlette.routing import BaseRoute, Host, Mount, Route, Router

from .policy import Policy
from .routing import _MAX_WRAPPERS, Found, _included, listed_routes, mounted_app
from .tenant import AUTH_FIX, authenticated_user_tenant

if TYPE_CHECKING:
    from .middleware import IdempotencyMiddleware

#: A middleware class found inside the app's own middleware list, on the way to a guarded
#: route, and where it is declared (the route's template, or the mount's path); see
#: `middleware_inside`.
Inside = Sequence[tuple[type, str] | None]

logger = logging.getLogger("idem_middleware")


def check_authentication(
    mw: IdempotencyMiddleware, app: Any, policies: list[Policy], inside: Inside = ()
) -> str | None:
    """With the default tenant resolver, Starlette's AuthenticationMiddleware must run first:
    warned when none is seen, an error (returned) when it is seen inside only (`inside`: on
    the way to a guarded route, see `middleware_inside`)."""
    if mw.tenant_resolver is not authenticated_user_tenant:
        return None
    stack = [entry.cls for entry in getattr(app, "user_middleware", ())]
    ours = _our_place(mw, app, stack)
    if ours == -1:
        # What it wraps runs inside it: IdempotencyMiddleware(AuthenticationMiddleware(app))
        # passed unseen (only the routed app's own list was read), every guarded request a 500.
        stack = list(_layers(mw.app))
    auth = [i for i, cls in enumerate(stack) if _named(cls, "AuthenticationMiddleware")]
    if ours is None or (ours < 0 and not auth):
        return None  # (its order cannot be read here; wrapping the app, what is outside it)
    anonymous = sum(p.allow_anonymous for p in policies)
    declared = _declared(inside, "AuthenticationMiddleware")
    before = any(i < ours for i in auth)
    if before and policies and (declared or any(i > ours for i in auth)):
        # The inner one names the caller again once the tenant was resolved: the handler serves
        # whom it names, the record is kept under whom the outer one named.
        where = f"on {', '.join(declared)}" if declared else "after it in the app's list"
        return (
            "AuthenticationMiddleware runs both before IdempotencyMiddleware and inside it "
            f"({where}): the inner one may name another caller than the tenant the request "
            "is recorded under, whose retries would then be replayed that caller's response. "
            "Authenticate once, before IdempotencyMiddleware (one backend may try several "
            "credentials), or pass tenant_resolver= naming the caller the handler serves"
        )
    if declared and not before:
        # The same as one after ours in the app's list: it names the caller only once the
        # tenant was resolved (no request of those routes can be named).
        return (
            f"AuthenticationMiddleware is declared on {', '.join(declared)} (a Route's, Mount's "
            "or Router's middleware=[...], or a mounted app's), so it runs after "
            "IdempotencyMiddleware and the tenant resolver finds no user: guarded requests of "
            f"authenticated callers there would all be refused (500): {AUTH_FIX}"
        )
    if not auth:
        if anonymous == len(policies):
            return None  # an app with anonymous routes only needs no authentication
        logger.warning(
            "idempotency: no AuthenticationMiddleware runs before IdempotencyMiddleware, so "
            "guarded requests have no tenant and are refused (500), unless another middleware "
            "sets scope['user']: %s",
            AUTH_FIX,
        )
    elif policies and all(i > ours for i in auth):
        # It sets scope["user"] after the tenant is resolved, and over whatever a middleware
        # before ours set: with the default resolver no request can be named. Guarded requests
        # would be refused (500), and on a route that allows anonymous callers every
        # authenticated one (its outcome never recorded: see CallerNamedLate). No order of
        # this kind works, so it fails the startup rather than every such request.
        wrapped = " (it is in the app IdempotencyMiddleware wraps)" if ours < 0 else ""
        return (
            f"AuthenticationMiddleware runs after IdempotencyMiddleware{wrapped}, so the tenant "
            "resolver finds no user: guarded requests of authenticated callers would all be "
            f"refused (500): {AUTH_FIX}"
        )
    return None


#: Middleware whose work on a response depends on the request it answers: inside ours, what it
#: made for the first request is stored and replayed to every retry.
_OUTSIDE = {
    "GZipMiddleware": "responses are stored compressed as the first request accepted, and "
    "replayed so to every retry, whatever its Accept-Encoding",
    "CORSMiddleware": "the middleware's own answers (400, 409, 422...) carry no CORS headers, "
    "and a replay carries those made for the first request's Origin",
    "HTTPSRedirectMiddleware": "its redirect of a plain-HTTP request is stored as a success, "
    "and the client following it with the same key is replayed the redirect to where it "
    "already is, never reaching the handler",
    # asgi-correlation-id's, or any of that name
    "CorrelationIdMiddleware": "a replay carries the first request's X-Request-ID, not the retry's",
    # opentelemetry-instrumentation-asgi's
    "OpenTelemetryMiddleware": "the middleware's own answers and replays never reach it "
    "(untraced), and a replay carries the first request's traceresponse header, if a "
    "response propagator sets one",
    # (only with its www_redirect on and a www. host allowed: `_www_redirect`)
    "TrustedHostMiddleware": "its redirect of a request for a host to that host's www. name "
    "is stored as a success, and the client following it with the same key is replayed the "
    "redirect to where it already is, never reaching the handler",
}

#: Middleware that never answers a request it sees cancelled (the cancellation passes through
#: it, or, BaseHTTPMiddleware, cancels the answer too): with only these before ours, nothing
#: but ours can tell the client of a cancelled request anything.
_LEAVES_CANCELLED = (
    "AuthenticationMiddleware",
    "BaseHTTPMiddleware",
    "CORSMiddleware",
    "CorrelationIdMiddleware",
    "GZipMiddleware",
    "HTTPSRedirectMiddleware",
    "OpenTelemetryMiddleware",
    "ProxyHeadersMiddleware",
    "SentryAsgiMiddleware",
    "SessionMiddleware",
    "SlowAPIASGIMiddleware",
    "TrustedHostMiddleware",
)


def check_outer_middleware(mw: IdempotencyMiddleware, app: Any, inside: Inside = ()) -> None:
    """Compression and CORS belong outside the middleware (warned, as the order can be read, and
    when declared on the way to a guarded route: `inside`); one outside it that may answer a
    request it cancels (a timeout) answers it alone."""
    for name, harm in _OUTSIDE.items():
        where = _declared(inside, name)
        if where and name != "TrustedHostMiddleware":  # (its 400 releases the key: harmless)
            logger.warning(
                "idempotency: %s is declared on %s, so it runs after IdempotencyMiddleware and "
                "%s: add it to the app's middleware, outside IdempotencyMiddleware",
                name,
                ", ".join(where),
                harm,
            )
    entries = list(getattr(app, "user_middleware", ()))
    stack = [entry.cls for entry in entries]
    ours = _our_place(mw, app, stack)
    if ours is None:
        return
    others = [
        getattr(cls, "__name__", repr(cls))
        for cls in stack[: max(ours, 0)]
        if not any(_named(cls, name) for name in _LEAVES_CANCELLED)
    ]
    if others:
        # A timeout middleware cancels the request, then sends its own answer (504): ours,
        # sent first, would reach the client in its place, and its own start be refused by the
        # server, an error logged for every request it times out.
        mw.answers_cancelled = False
        logger.info(
            "idempotency: a cancelled guarded request is not answered 503 request-cancelled: "
            "%s runs before IdempotencyMiddleware and may answer it (as a timeout does)",
            ", ".join(others),
        )
    _warn_unknown_inside(stack[ours + 1 :])
    found = {name for name in _OUTSIDE if any(_named(c, name) for c in stack[ours + 1 :])}
    if not any(_www_redirect(entry) for entry in entries[ours + 1 :]):
        found.discard("TrustedHostMiddleware")  # its 400 releases the key: harmless
    for name, harm in _OUTSIDE.items():
        if name in found:
            logger.warning(
                "idempotency: %s runs after IdempotencyMiddleware, so %s: add it after "
                "installing IdempotencyMiddleware (app.add_middleware(%s, ...) after "
                "install(...): the middleware added last runs first; in a middleware=[...] "
                "list, before it)",
                name,
                harm,
                name,
            )


#: Middleware known to leave a request's path, root path and method as they are.
_KEEPS_THE_ROUTE = (set(_OUTSIDE) | set(_LEAVES_CANCELLED) | {"IdempotencyMiddleware"}) - {
    "BaseHTTPMiddleware"
}


def _warn_unknown_inside(inside: Sequence[Any]) -> None:
    """The middleware matches a request's route by its path and method as they reach it: one
    inside it that changes either (a locale prefix stripped, X-HTTP-Method-Override) sends the
    request to a route the middleware saw as unguarded, and it runs unguarded. Which one does
    cannot be read, so every middleware not known to keep them is named."""
    unknown = sorted(
        {
            getattr(cls, "__name__", repr(cls))
            for cls in inside
            if not any(_named(cls, name) for name in _KEEPS_THE_ROUTE)
        }
    )
    if unknown:
        logger.warning(
            "idempotency: %s runs after IdempotencyMiddleware, which finds a request's route by "
            "the path and method it receives: a middleware that changes either (strips a "
            "prefix, honours X-HTTP-Method-Override) sends requests to routes the middleware "
            "saw as unguarded, and they run unguarded. Add such a middleware outside "
            "IdempotencyMiddleware",
            ", ".join(unknown),
        )


def middleware_inside(
    routes: Sequence[BaseRoute], guarded: Sequence[Found], prefix: str = "", depth: int = 0
) -> Iterator[tuple[type, str] | None]:
    """The middleware declared on the way to each guarded route, below the app's own list: on
    the route, on each Mount or Host it is under, on a Router, in a mounted app's own list.
    All of it runs inside IdempotencyMiddleware. None for each guarded route reached.
    (`guarded`: as `walk` lists them, named maybe with a prefix from a router above: see
    `startup._named_above`.)"""
    # (Asked per route, a scan of them all each was quadratic: 20,000 routes took seven seconds.)
    by_ending: dict[tuple[int, str], list[str]] = {}
    for found in guarded:
        for ending in endings(found.template):
            by_ending.setdefault((id(found.endpoint), ending), []).append(found.template)
        by_ending.setdefault((id(found.endpoint), ""), []).append(found.template)
    return _inside(routes, by_ending, prefix, depth)


def endings(template: str) -> Iterator[str]:
    """Each ending of `template` that starts with a slash: a template ends with a path that
    starts with one (a route's, with a prefix before it) exactly when that is one of them."""
    slash = template.find("/")
    while slash >= 0:
        yield template[slash:]
        slash = template.find("/", slash + 1)


def _inside(
    routes: Sequence[BaseRoute],
    guarded: dict[tuple[int, str], list[str]],
    prefix: str,
    depth: int,
) -> Iterator[tuple[type, str] | None]:
    """`middleware_inside`, its guarded routes' templates kept by endpoint and each of their
    `endings` (by endpoint alone under "")."""
    for route in routes:
        if isinstance(route, Route):
            template = prefix + route.path
            if template.startswith("/"):
                reached = (id(route.endpoint), template) in guarded
            else:  # (under a Host: its pattern first)
                of_endpoint = guarded.get((id(route.endpoint), ""), ())
                reached = any(t.endswith(template) for t in of_endpoint)
            if reached:
                yield None
                yield from ((cls, template) for cls in _layers(route.app))
        elif (contexts := _included(route)) is not None:
            mounted = [c.starlette_route for c in contexts if c.starlette_route is not None]
            yield from _inside(mounted, guarded, prefix, depth)
        elif isinstance(route, Mount | Host) and depth < _MAX_WRAPPERS:
            where = prefix + route.path if isinstance(route, Mount) else route.host + prefix
            inner = listed_routes(mounted_app(route))
            below = [] if inner is None else list(_inside(inner, guarded, where, depth + 1))
            if below:  # (a guarded route under it)
                # (the app below the Mount's own list too: a wrapper there may hide it)
                for app in (route.app, mounted_app(route)):
                    yield from ((cls, where or "/") for cls in _layers(app))
                yield from below


def _declared(inside: Inside, name: str) -> list[str]:
    return sorted({found[1] for found in inside if found is not None and _named(found[0], name)})


def _layers(app: Any) -> Iterator[type]:
    """The middleware classes wrapping `app` (a Route's or Mount's), down to its endpoint or
    the routes it dispatches to: those of a `middleware=[...]`, of a Router's, of a Starlette
    or FastAPI app's own list."""
    for _ in range(_MAX_WRAPPERS):
        if app is None or inspect.isroutine(app):
            return
        if isinstance(app, Router):
            stack = getattr(app, "middleware_stack", None)  # (Starlette >= 1.0)
            for _ in range(_MAX_WRAPPERS):
                if stack is None or inspect.isroutine(stack):
                    return
                yield type(stack)
                stack = getattr(stack, "app", None)
            return
        if isinstance(router := getattr(app, "router", None), Router):
            yield from (entry.cls for entry in getattr(app, "user_middleware", ()))
            app = router
            continue
        yield type(app)
        app = getattr(app, "app", None)


def root_path_below(app: Any) -> str:
    """The root path an app the middleware wraps by hand sets as it is called, after the
    middleware has found the request's route (`FastAPI(root_path="/api")`); "" for none. The
    route is found with it (`POST /api/pay` is the router's `/pay`): found with the server's,
    it was found nowhere, and ran with no key."""
    for _ in range(_MAX_WRAPPERS):
        if app is None or isinstance(app, Router):
            return ""
        root_path = getattr(app, "root_path", None)
        if isinstance(root_path, str) and isinstance(getattr(app, "router", None), Router):
            return root_path
        app = getattr(app, "app", None)
    return ""


def _www_redirect(entry: Any) -> bool:
    """Whether a middleware list entry is a TrustedHostMiddleware that redirects to `www.`."""
    if not _named(entry.cls, "TrustedHostMiddleware"):
        return False
    args: tuple[Any, ...] = tuple(getattr(entry, "args", ()))
    kwargs: dict[str, Any] = dict(getattr(entry, "kwargs", {}))
    hosts = kwargs.get("allowed_hosts", args[0] if args else None) or ()
    on = kwargs.get("www_redirect", args[1] if len(args) > 1 else True)
    return bool(on) and any(str(host).startswith("www.") for host in hosts)


def _our_place(mw: IdempotencyMiddleware, app: Any, stack: list[Any]) -> int | None:
    """Where the middleware is in the app's own middleware list; -1 when it wraps the app
    (`IdempotencyMiddleware(app, ...)`: all of that list runs inside it); None when unknown."""
    ours = next((i for i, cls in enumerate(stack) if _named(cls, "IdempotencyMiddleware")), None)
    return -1 if ours is None and mw.app is app else ours


def _named(cls: Any, name: str) -> bool:
    return any(base.__name__ == name for base in getattr(cls, "__mro__", ()))

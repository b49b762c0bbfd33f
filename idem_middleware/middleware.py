"""The pure-ASGI Idempotency-Key middleware: its configuration, and which requests it guards
under which policy. Each guarded request is an `exchange.Exchange` (see there for the request
path). No SQL here and no FastAPI: the store does the former, `fastapi.py` the latter.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import sys
import types
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar

from starlette.types import ASGIApp, Receive, Scope, Send

from .body_limits import follow_route_limit, in_force, mounted_limit
from .capture import hide_sent_by_server
from .context import SCOPE_KEY
from .endpoints import HANDLED, Handled, endpoint_policy
from .errors import ConfigurationError, ProblemKind
from .exchange import Exchange
from .fingerprint import Fingerprinter
from .keys import header_map, host_header
from .middleware_arguments import KILL_SWITCH_ENV as KILL_SWITCH_ENV
from .middleware_arguments import METHOD, check_arguments, named_route, switched
from .middleware_order import root_path_below
from .observe import Event, Observer, combine
from .policy import MAX_OPERATION_BYTES, Policy, RouteMatch, operation_name
from .policy_values import names
from .responses import DEFAULT_PROBLEM_BASE, send_problem
from .route_cache import (
    CACHED_KEY_LENGTH,
    ROUTE_CACHE_SIZE,
    UNGUARDED,
    UNNAMEABLE,
    Entry,
    Guarded,
    Seen,
    Trace,
    Untraced,
    defaults_unchanged,
    entry,
    unchanged,
)
from .route_candidates import Memo
from .route_guard import RouteGuards, route_guard, unresolved_guard
from .routing import (
    Limits,
    Unresolved,
    app_below,
    match_route,
    routed_above,
    router_of,
)
from .startup import DEFAULT_METHODS, SAFE_METHODS, check_app
from .startup_store import checked_first, checked_lifespan, store_checked
from .store.base import Store
from .tenant import TenantResolver as TenantResolver
from .tenant import Tenants
from .tenant import authenticated_user_tenant as authenticated_user_tenant
from .waiting import TenantSlots, Waiters

logger = logging.getLogger("idem_middleware")


_UNNAMEABLE_DETAIL = (
    f"The request's method and path name an operation of over {MAX_OPERATION_BYTES} bytes, or "
    "with a character no record can hold (NUL). The request was not processed."
)
_F = TypeVar("_F", bound=Callable[..., Any])
_NO_ROUTER = types.SimpleNamespace(routes=None)  # (an app whose routes cannot be seen)


def _marked_coroutine_function(func: _F) -> _F:
    """Marks a function that returns a coroutine as a coroutine function, as asgiref's
    `markcoroutinefunction` does: ASGI servers and test clients (uvicorn, Starlette's
    TestClient) tell an ASGI 3 app from an ASGI 2 one by `iscoroutinefunction(app.__call__)`."""
    if sys.version_info >= (3, 12):
        return inspect.markcoroutinefunction(func)
    func._is_coroutine = asyncio.coroutines._is_coroutine  # type: ignore[attr-defined,unused-ignore]
    return func


class IdempotencyMiddleware:
    """Guards POST and PATCH (`methods`), and every route with an explicit policy whatever its
    method (safe methods never), with Idempotency-Key. `methods=()` guards only routes with a
    policy of their own (`@idempotent` or `policies`).

    Add it *inside* authentication, so the tenant resolver sees the authenticated user. Before it
    serves (at lifespan startup, or at the first request without one) it checks the app's routes
    once: see `startup.check_app`.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        store: Store,
        default_policy: Policy | None = None,
        policies: Mapping[str, Policy] | None = None,
        methods: Collection[str] = DEFAULT_METHODS,
        tenant_resolver: TenantResolver = authenticated_user_tenant,
        problem_base: str = DEFAULT_PROBLEM_BASE,
        acquire_timeout: float = 10.0,
        enabled: bool | None = None,
        status_path: str = "/idempotency/status",
        observers: Observer | Sequence[Observer] | None = None,
        max_waiters: int = 1024,
        max_tenant_connections: int | None = None,
        www_authenticate: str | None = None,
    ) -> None:
        check_arguments(
            store,
            default_policy,
            acquire_timeout,
            enabled,
            status_path,
            problem_base,
            observers,
        )
        self.app = app
        #: The root path a FastAPI app wrapped by hand sets as it is called (middleware_order).
        self.root_path_below = root_path_below(app)
        self.store = store
        # The store's own checkouts (lease mode's) wait no longer for the pool than claims do.
        bound_checkouts = getattr(store, "bound_checkouts", None)
        if callable(bound_checkouts):
            bound_checkouts(acquire_timeout)
        self.default_policy = default_policy or Policy()
        self.methods = frozenset(m.upper() for m in names(methods, "methods"))
        if bad := sorted(m for m in self.methods if not METHOD.fullmatch(m)):
            raise ConfigurationError(f"methods: {', '.join(map(repr, bad))} is not an HTTP method")
        if self.methods & SAFE_METHODS:
            raise ConfigurationError("safe methods are never guarded")
        if policies is not None and not isinstance(policies, Mapping):
            raise ConfigurationError('policies must map "METHOD /template" to a Policy')
        self.policies: dict[str, Policy] = {}
        for name, policy in (policies or {}).items():
            text = str.__str__(name) if isinstance(name, str) else str(name)  # (an enum's text)
            method, _, template = text.partition(" ")
            if not named_route(template) or method.upper() != method or not method:
                raise ConfigurationError(f"policy key {name!r} is not 'METHOD /template'")
            if method in SAFE_METHODS:
                raise ConfigurationError(f"policy key {name!r}: {method} is never guarded")
            if not isinstance(policy, Policy):
                raise ConfigurationError(f"policies[{name!r}] is not a Policy")
            self.policies[name] = policy
        self.tenant_resolver = tenant_resolver
        self.problem_base = problem_base
        self.acquire_timeout = acquire_timeout
        self.status_path = str.__str__(status_path)  # (its text: an enum member writes its name)
        self.observer = combine(observers)
        #: Duplicates waiting (with no connection) for a key held elsewhere, in this process.
        self.waiters = Waiters(max_waiters)
        #: Guarded requests of one tenant holding a store connection at once, in this process.
        self.tenant_slots = TenantSlots(max_tenant_connections)
        self.enabled = switched(enabled)  # (the kill switch wins over enabled=True)
        self.tenants = Tenants(tenant_resolver, challenge=www_authenticate)
        #: `send_problem` under this middleware's problem base, a 401 with its challenge.
        self.send_problem = functools.partial(
            send_problem, base=problem_base, challenge=self.tenants.challenge
        )
        #: Whether a cancelled guarded request is answered 503 (`responses.answer_cancelled`).
        self.answers_cancelled = True
        # The startup check runs once; a failed one fails every request after it too.
        self._checked = False
        self._check_error: ConfigurationError | None = None
        # The store's startup check (`startup_store`): None until the lifespan or a first
        # request starts it, its task while it runs, True once it is over (or none is needed).
        self._store_check: Any = None if hasattr(store, "check_given_pool") else True
        #: Per (app, method, root path, path, Host): the resolution and its route lists (`Entry`).
        self._routes: dict[tuple[Any, ...], Entry] = {}
        #: What the misses of the route cache work out once (the routes each path can reach).
        self._route_memo = Memo()
        self._untraced = Untraced(self._route_memo)  # (a first-seen path's: see _route)
        self._seen = Seen()  # (the paths resolved once: the cache keeps their second)
        #: Per route (method, template, endpoint, body limit): what guards it (route_guard).
        self._route_guards: RouteGuards = {}
        #: Per app served (by id): see `_router_below`; the last one's read first (`_resolve`).
        self._routers: dict[int, tuple[Any, Any, Any, Any]] = {}
        self._last_below: tuple[Any, Any, Any, Any] = (object(), _NO_ROUTER, None, None)
        if sys.version_info < (3, 12):
            # hypercorn tells an ASGI 3 app by `inspect.iscoroutinefunction(app.__call__)`, which
            # before 3.12 reads the code's flags alone (not asyncio's mark): it served the
            # middleware as a WSGI app, a 500 for every request. An `async def` on the instance
            # answers it; a server's `app(...)` still calls the class's `__call__`, a frame fewer.
            self.__dict__["__call__"] = self._awaited

    @_marked_coroutine_function
    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        """Decides, without awaiting, who handles the request, and returns that coroutine for the
        server to await: no frame of the middleware's is above the exchange and its handler's
        awaits. (Servers tell ASGI 3 apps by `__call__`: see `_marked_coroutine_function`.)"""
        if scope["type"] == "lifespan":
            return checked_lifespan(self, scope, receive, send)  # (startup_store)
        if scope["type"] != "http":
            return self.app(scope, receive, send)
        if not self._checked:
            if asyncio._get_running_loop() is None:  # (made before its loop: checked in it)
                return checked_first(self, scope, receive, send)  # (startup_store)
            self._check(app_below(self, scope.get("app")), scope)
        if self._check_error is not None:
            return self._refuse(send)
        if self._store_check is not True:
            return store_checked(self, scope, receive, send)  # (a pool given, no lifespan)
        method = scope["method"]
        if method in SAFE_METHODS or not self.enabled or SCOPE_KEY in scope:
            # (SCOPE_KEY: an outer IdempotencyMiddleware guards this request already. A safe
            # method's scope: decorated endpoints run while it is one, see endpoints.HANDLED.)
            how = scope if method in SAFE_METHODS and self.enabled else Handled.YES
            return self._pass_on(scope, receive, send, how)
        app = scope.get("app")
        by_name = header_map(scope)
        host = host_header(scope) if by_name is None else by_name.get(b"host")
        cache_key = (app, method, scope.get("root_path", ""), scope["path"], host)
        cached = self._routes.get(cache_key)
        # (A cached match holds while the route lists it walked are their routers' and keep their
        # lengths, and the routers it fell through keep their defaults: route_cache.)
        if (
            cached is not None
            and cached[1].routes is cached[2]
            and len(cached[2]) == cached[3]
            and (cached[4] is None or unchanged(cached[4]))
            and (cached[5] is None or defaults_unchanged(cached[5]))
        ):
            guarded: Guarded | None = cached[0]
        else:
            guarded = self._route(app, method, scope, cache_key)
        if guarded is UNGUARDED:
            # No guarding policy on the route found, if any: an @idempotent endpoint reached
            # all the same is one the middleware could not see, and refuses to run.
            return self._pass_on(scope, receive, send, Handled.UNSEEN)
        if guarded is None:
            return self._misconfigured(send, "This operation cannot be guarded.")
        if guarded is UNNAMEABLE:
            return self._rejected(send, ProblemKind.OPERATION_INVALID, _UNNAMEABLE_DETAIL)
        fingerprinter, policy, operation, body_limit = guarded
        if body_limit is not None:  # (the route's own max_body_size: see body_limits)
            follow_route_limit(scope, body_limit)
        # ("user" first: with it in the scope the check cannot fail, and costs no call.)
        if "user" not in scope and self.tenants.unidentifiable(
            scope, allow_anonymous=policy.allow_anonymous
        ):
            return self._misconfigured(send, "The server cannot identify the caller.", operation)
        if "extensions" in scope:
            hide_sent_by_server(scope)
        # A guarded request's endpoint runs under its claim's context, which decorated endpoints
        # accept as proof that the middleware handled the request (see endpoints.idempotent).
        return Exchange(self, scope, receive, send, fingerprinter, policy, operation, by_name).run()

    async def _awaited(self, scope: Scope, receive: Receive, send: Send) -> None:
        """`__call__` as a coroutine function of its own (see `__init__`)."""
        await IdempotencyMiddleware.__call__(self, scope, receive, send)

    async def _pass_on(
        self, scope: Scope, receive: Receive, send: Send, how: Handled | Scope
    ) -> None:
        # (Decorated endpoints run only with Handled.YES, a safe method's scope or a claim.)
        handled = HANDLED.set(how)
        try:
            await self.app(scope, receive, send)
        finally:
            HANDLED.reset(handled)

    def _route(self, app: Any, method: str, scope: Scope, cache_key: tuple[Any, ...]) -> Any:
        """`_resolve`, kept in the route cache with the route lists it depended on (from the
        path's second request: Seen), unless it depended on more than the cache's key (Trace)."""
        # (A path met for the first time is not kept: resolved without noting what for.)
        kept = self._seen.again(cache_key) and (
            len(method) + len(cache_key[2]) + len(cache_key[3]) + len(cache_key[4] or b"")
            <= CACHED_KEY_LENGTH
        )
        trace = Trace(self._route_memo) if kept else self._untraced
        if self.root_path_below:  # (the route found as the app will find it: see __init__)
            scope = {**scope, "root_path": self.root_path_below}
        guarded = self._resolve(app, method, scope, trace)
        if kept and guarded is not None and not trace.volatile:
            if len(self._routes) >= ROUTE_CACHE_SIZE:
                self._routes.clear()  # many distinct paths (ids in them): start over
            self._routes[cache_key] = entry(guarded, trace)
        return guarded

    def _resolve(
        self, app: Any, method: str, scope: Scope, trace: Trace | None = None
    ) -> Guarded | None:
        """The route a request matches, the policy guarding it and its operation's name, the
        way the router will find it; `UNGUARDED` for a request the middleware passes on,
        `UNNAMEABLE` for one whose operation no record can hold (its own method or path), None
        for a route that would be guarded but cannot be named (refused)."""
        last = self._last_below  # (the app served last, most requests': see _router_below)
        if last[0] is app and last[1].routes is last[2]:
            routes, limits, router = last[3]
        else:
            routes, limits, router = self._router_below(app)
        match = (
            match_route(routes, scope, "", trace, limits, router) if routes is not None else None
        )
        if match is None:
            return UNGUARDED
        if "router" in scope and isinstance(match, RouteMatch):
            match = routed_above(scope, match, trace)  # this app is mounted in another's router
        if isinstance(match, Unresolved):
            return unresolved_guard(self, method, match)
        body_limit = in_force(scope, match.body_limit, match.least_limit)
        key = (method, match.template, id(match.endpoint), body_limit)
        known = self._route_guards.get(key)  # (what guards the route: see route_guard)
        if known is not None:  # (its endpoint kept alive with it: the id is that endpoint's)
            named: Any = known[0]  # (a Named, or the sentinel UNGUARDED or UNNAMEABLE)
        elif (named := route_guard(self, method, match, body_limit, key)) is None:
            return None
        if named is UNGUARDED or named is UNNAMEABLE:
            return named
        policy, operation = named
        fingerprinter = Fingerprinter(operation, match.path_params, policy)
        return fingerprinter, policy, operation, body_limit

    def _router_below(self, app: Any) -> tuple[Sequence[Any] | None, Limits, Any]:
        """The routes of the app this middleware guards (`app`: the request's, see
        `routing.app_below`), its router's own body limit (the app's, under FastAPI; see
        body_limits) as match_route takes it, and its router. Found once per app; again when
        its router's route list is another list (an app's middleware stack is built once, and
        its router is its router for good). Each entry: the app, its router (`_NO_ROUTER`:
        none), its route list then, and the answer; the last one served, `_last_below`."""
        entry = self._routers.get(id(app))
        if entry is not None and entry[0] is app and entry[1].routes is entry[2]:
            self._last_below = entry
            return entry[3]  # type: ignore[no-any-return]
        below = app_below(self, app)
        router = router_of(below)
        routes = None if router is None else router.routes
        memo = self._route_memo
        limit = mounted_limit(below, own=False, memo=memo) if routes is not None else None
        if len(self._routers) >= ROUTE_CACHE_SIZE:
            self._routers.clear()  # (apps made at run time, each serving requests: start over)
        holder = _NO_ROUTER if router is None else router
        found = routes, (limit, limit), router
        self._routers[id(app)] = self._last_below = (app, holder, routes, found)
        return found

    def policy_for(
        self, method: str, route: RouteMatch | Any, operation: str | None = None
    ) -> Policy | None:
        """The policy guarding `method` on `route` (anything with `template` and `endpoint`;
        `operation`: its name, if known): the endpoint's own, else `policies`, else the default
        for `methods`; None if unguarded."""
        policy = endpoint_policy(route.endpoint, method)
        if policy is None and self.policies:
            policy = self.policies.get(operation or operation_name(method, route.template))
        if policy is None and method in self.methods:
            policy = self.default_policy
        return policy if policy is not None and policy.guard else None

    async def _refuse(self, send: Send) -> None:
        """After a failed check at a request (no lifespan startup reached the middleware), every
        request: a 500 problem document for the client, and the check's error raised for the
        server to log (and a test client to raise)."""
        try:
            await self._misconfigured(send, "The server failed its startup check.", None)
        except Exception as exc:  # (the client gone, say): the check's error is what to tell
            raise self._failed_check() from exc
        raise self._failed_check()  # (a cancellation goes on as it is)

    def _failed_check(self) -> ConfigurationError:
        """The failed check's error, a new one for each raise: one exception object raised again
        and again grows its traceback by the raising request's frames each time, and keeps them
        (and the requests they served) alive."""
        assert self._check_error is not None
        return ConfigurationError(*self._check_error.args)

    def _misconfigured(
        self, send: Send, detail: str, operation: str | None = "OTHER"
    ) -> Awaitable[None]:
        detail += " The server is misconfigured; the request was not processed."
        return self._rejected(send, ProblemKind.MISCONFIGURED, detail, operation)

    def _rejected(
        self, send: Send, kind: ProblemKind, detail: str, operation: str | None = "OTHER"
    ) -> Awaitable[None]:
        """Refused before an exchange: counted `rejected` as an exchange's refusals are (under
        `OTHER` where no operation is named; not at all with None: a failed startup check)."""
        if self.observer is not None and operation is not None:
            self.observer.event(Event.REJECTED, {"operation": operation})
        return self.send_problem(send, kind, detail)

    def _check(self, app: Any, scope: Scope | None = None) -> None:
        self._checked = True
        try:
            check_app(self, app, scope)
        except ConfigurationError as exc:
            logger.error("idempotency: %s", exc)
            self._check_error = exc
        except Exception as exc:  # a check that cannot run fails every request, as a failed one
            logger.error("idempotency: the startup check failed", exc_info=True)
            self._check_error = ConfigurationError(f"the startup check failed: {exc!r}")

"""Whose request this is: the tenant a key lives in, taken from authentication only.

One resolution for every edge that needs a tenant (the middleware, the status resource, the token
route): a resolver, sync or async, read from the request scope; `allow_anonymous` turns "no
caller" into the anonymous tenant ""; and with the default resolver, a scope with no `user` at
all is the server's misconfiguration (no AuthenticationMiddleware ran first), not the client's.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable

from starlette.responses import Response
from starlette.types import Scope

from .errors import ProblemKind
from .responses import problem_response

logger = logging.getLogger("idem_middleware")

#: `scope -> tenant`, sync or async; None or "" when the caller is not authenticated.
TenantResolver = Callable[[Scope], "Awaitable[str | None] | str | None"]

AUTH_FIX = (
    "add Starlette's AuthenticationMiddleware after installing IdempotencyMiddleware "
    "(app.add_middleware(AuthenticationMiddleware, backend=...) after install(...): the "
    "middleware added last runs first), or pass tenant_resolver= to IdempotencyMiddleware"
)


def authenticated_user_tenant(scope: Scope) -> str | None:
    """The default tenant: the identity of the user Starlette's AuthenticationMiddleware set."""
    user = scope.get("user")
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    try:
        identity = user.identity
    except NotImplementedError:
        identity = user.display_name
    return str(identity) or None


class Tenants:
    """A tenant resolver as an edge uses it. One per middleware or route, made at setup."""

    __slots__ = ("_default", "_logged", "resolver")

    def __init__(self, resolver: TenantResolver = authenticated_user_tenant) -> None:
        self.resolver = resolver
        self._default = resolver is authenticated_user_tenant
        self._logged = False

    def unidentifiable(self, scope: Scope, *, allow_anonymous: bool = False) -> bool:
        """True when the default resolver can never name a caller here: nothing set
        `scope["user"]`. Logged once (an error with the fix); the caller answers 500."""
        if not self._default or allow_anonymous or "user" in scope:
            return False
        if not self._logged:
            self._logged = True
            logger.error(
                "idempotency: the request scope has no 'user', so no tenant: no "
                "AuthenticationMiddleware ran before IdempotencyMiddleware. Guarded requests "
                "are refused with 500 until it is fixed: %s",
                AUTH_FIX,
            )
        return True

    def resolve(
        self, scope: Scope, *, allow_anonymous: bool = False
    ) -> str | Awaitable[str | None] | None:
        """The caller's tenant; "" for an anonymous caller when allowed; None: refuse (401).
        From a resolver that returns an awaitable, an awaitable of that answer: the caller
        awaits what is neither a str nor None (a synchronous resolver costs no coroutine)."""
        resolved = self.resolver(scope)
        if resolved is not None and not isinstance(resolved, str) and inspect.isawaitable(resolved):
            return self._awaited(resolved, allow_anonymous)  # (str first: isawaitable is an ABC)
        if resolved:
            return resolved
        return "" if allow_anonymous else None

    async def _awaited(self, resolved: Awaitable[str | None], allow_anonymous: bool) -> str | None:
        tenant = await resolved
        if tenant:
            return tenant
        return "" if allow_anonymous else None


async def route_tenant(tenants: Tenants, scope: Scope, *, problem_base: str) -> str | Response:
    """For the library's own routes (status, tokens): the caller's tenant, or the problem to
    answer with: 500 when nothing can name a caller, 401 when this one is not authenticated."""
    if tenants.unidentifiable(scope):
        return problem_response(
            ProblemKind.MISCONFIGURED,
            "The server cannot identify the caller. The server is misconfigured; the request "
            "was not processed.",
            base=problem_base,
        )
    tenant = tenants.resolve(scope)
    if tenant is not None and not isinstance(tenant, str):
        tenant = await tenant
    if tenant is None:
        return problem_response(
            ProblemKind.UNAUTHENTICATED, "This resource needs authentication.", base=problem_base
        )
    return tenant

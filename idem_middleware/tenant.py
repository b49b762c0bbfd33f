"""Whose request this is: the tenant a key lives in, taken from authentication only.

One resolution for every edge that needs a tenant (the middleware, the status resource, the token
route): a resolver, sync or async, read from the request scope; `allow_anonymous` turns "no
caller" into the anonymous tenant ""; and with the default resolver, a scope with no `user` at
all is the server's misconfiguration (no AuthenticationMiddleware ran first), not the client's.
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Awaitable, Callable

from starlette.authentication import SimpleUser
from starlette.exceptions import HTTPException
from starlette.requests import HTTPConnection
from starlette.responses import Response
from starlette.types import Scope

from .errors import CallerNamedLate, ConfigurationError, ProblemKind, RequestRejected
from .refusals import is_refusal, refusal_response
from .responses import problem_response

logger = logging.getLogger("idem_middleware")

#: `scope -> tenant`, sync or async; None or "" when the caller is not authenticated.
TenantResolver = Callable[[Scope], "Awaitable[str | None] | str | None"]

#: Set on the endpoints of the library's own routes (status, tokens) to the resolver they were
#: given, so that the middleware's startup check can compare it with its own.
ROUTE_RESOLVER_ATTRIBUTE = "__idem_tenant_resolver__"
#: Set on them to their `Tenants`: a route given no challenge takes the middleware's at startup.
ROUTE_TENANTS_ATTRIBUTE = "__idem_tenants__"

AUTH_FIX = (
    "add Starlette's AuthenticationMiddleware after installing IdempotencyMiddleware "
    "(app.add_middleware(AuthenticationMiddleware, backend=...) after install(...): the "
    "middleware added last runs first), or pass tenant_resolver= to IdempotencyMiddleware"
)


# RFC 9110 §11.6.1: `WWW-Authenticate = #challenge`, a challenge being an auth-scheme, then
# optionally a token68 or auth-params (`name=token` or `name="quoted string"`).
_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_PARAM = rf'{_TOKEN}[ \t]*=[ \t]*(?:{_TOKEN}|"(?:[\t !#-\[\]-~]|\\[\t -~])*")'
_CHALLENGE = rf"{_TOKEN}(?: +(?:[A-Za-z0-9._~+/-]+=*|{_PARAM}(?:[ \t]*,[ \t]*{_PARAM})*))?"
_CHALLENGES = re.compile(rf"{_CHALLENGE}(?:[ \t]*,[ \t]*{_CHALLENGE})*")


def www_authenticate(value: object) -> bytes | None:
    """The `www_authenticate` option checked, as the header's bytes (None: no challenge).

    RFC 9110 requires a 401 to carry a challenge, and only the app knows its scheme: `"Bearer"`,
    `'Basic realm="api"'`, `'Bearer realm="api", Basic'`."""
    if value is None:
        return None
    if not isinstance(value, str) or _CHALLENGES.fullmatch(value) is None:
        raise ConfigurationError(
            f"www_authenticate must be the challenge a 401 carries in WWW-Authenticate "
            f"(RFC 9110: an auth scheme, then optionally a token68 or auth-params), such as "
            f"'Bearer' or 'Basic realm=\"api\"', not {value!r}"
        )
    return value.encode("ascii")


class Unidentified(RequestRejected):
    """The default resolver's answer for an authenticated user it cannot name: a user class
    without an `identity` (its `display_name` is not unique: two users would share their
    records), or one whose identity is not a string or an integer (None is no one's). The
    request is refused (500), never run in a tenant two callers share."""

    def __init__(self, why: str) -> None:
        super().__init__(ProblemKind.MISCONFIGURED, _CANNOT_IDENTIFY)
        self.why = why


_CANNOT_IDENTIFY = (
    "The server cannot identify the caller. The server is misconfigured; the request was not "
    "processed."
)


def authenticated_user_tenant(scope: Scope) -> str | None:
    """The default tenant: the identity of the user Starlette's AuthenticationMiddleware set
    (an integer identity as its decimal digits). Raises `Unidentified` for a user it cannot
    name."""
    user = scope.get("user")
    if user is None:
        return None
    try:
        authenticated = getattr(user, "is_authenticated", None)
    except NotImplementedError:  # (a BaseUser that leaves it to its subclasses)
        authenticated = None
    if authenticated is not True:
        if authenticated is False:
            return None
        # A user the app's own middleware set (a dict, a model), or one whose is_authenticated
        # is a method (always true): taken for anonymous, callers who are someone shared "";
        # taken for authenticated, callers who are no one shared a name.
        why = f"its is_authenticated is {type(authenticated).__name__}, not True or False"
        raise Unidentified(f"the user object {type(user).__name__} cannot be read: {why}")
    try:
        identity = user.identity
    except (NotImplementedError, AttributeError):  # (a class of its own, not a BaseUser)
        if type(user) is not SimpleUser:
            why = f"the user class {type(user).__name__} implements no identity"
            raise Unidentified(why) from None
        identity = user.username  # Starlette before 1.7 gave it none; since, it is its username
    if type(identity) is str:
        return identity or None
    if isinstance(identity, int) and not isinstance(identity, bool):
        return str(identity)
    raise Unidentified(f"the user's identity is a {type(identity).__name__}, not a str or an int")


def _fastapi_marker(parameter: inspect.Parameter) -> object:
    """A FastAPI parameter marker (`Header()`, `Depends(...)`, `Query()`, ...) given to the
    parameter as its default or in its `Annotated[...]`; None if none is."""
    candidates = [parameter.default, *getattr(parameter.annotation, "__metadata__", ())]
    for candidate in candidates:
        if type(candidate).__module__ == "fastapi.params":
            return candidate
    return None


def _is_connection(annotation: object) -> bool:
    """Whether a parameter's annotation is Starlette's (or FastAPI's) Request, WebSocket or
    HTTPConnection, or a class of theirs."""
    return isinstance(annotation, type) and issubclass(annotation, HTTPConnection)


def _check_resolver(resolver: object) -> None:
    """A resolver is called with the ASGI scope, one positional argument: a FastAPI dependency
    given as one (its parameters `Header()`, `Depends(...)`) passed the startup and failed every
    guarded request with an error from inside the app's own code, naming neither."""
    if not callable(resolver):
        raise ConfigurationError(f"tenant_resolver must be a function, not {resolver!r}")
    fix = (
        "it is called with the request's ASGI scope (one argument), not as a FastAPI "
        "dependency: read the credential from the scope, as `bearer_tenant(scope)` does in "
        "docs/fastapi.md, and keep the dependency for your routes"
    )
    # A FastAPI security scheme (HTTPBearer(), OAuth2PasswordBearer(...), APIKeyHeader(...)) is
    # called with a Request: given the scope, it failed every guarded request.
    if any(kind.__module__.startswith("fastapi.security") for kind in type(resolver).__mro__):
        what = type(resolver).__name__
        raise ConfigurationError(f"tenant_resolver is a FastAPI security scheme ({what}): {fix}")
    # (What is called: a `functools.wraps` wrapper's own signature, not the function it wraps.)
    try:
        signature = inspect.signature(resolver, follow_wrapped=False, eval_str=True)
    except Exception:  # (no signature to read, or annotations that cannot be resolved here)
        try:
            signature = inspect.signature(resolver, follow_wrapped=False)
        except (TypeError, ValueError):
            return
    for name, parameter in signature.parameters.items():
        marker = _fastapi_marker(parameter)
        if marker is not None:
            what = type(marker).__name__
            raise ConfigurationError(f"tenant_resolver's parameter {name!r} is a {what}(): {fix}")
        if _is_connection(parameter.annotation):  # (`request: Request`: given the scope)
            raise ConfigurationError(
                f"tenant_resolver's parameter {name!r} is annotated as a request, but the "
                f"resolver is given the ASGI scope (a dict: scope['headers'], not "
                f"request.headers): {fix}"
            )
    try:
        signature.bind(object())
    except TypeError as exc:
        raise ConfigurationError(
            f"tenant_resolver cannot be called as resolver(scope) ({exc}): {fix}"
        ) from None


class Tenants:
    """A tenant resolver as an edge uses it. One per middleware or route, made at setup."""

    __slots__ = ("_default", "_logged", "_refusal_logged", "challenge", "resolver")

    def __init__(
        self, resolver: TenantResolver = authenticated_user_tenant, *, challenge: object = None
    ) -> None:
        if resolver is not authenticated_user_tenant:
            _check_resolver(resolver)
        self.resolver = resolver
        #: What a 401 (no authenticated caller) carries in WWW-Authenticate; None: nothing.
        self.challenge = www_authenticate(challenge)
        self._default = resolver is authenticated_user_tenant
        self._logged = False
        self._refusal_logged = False

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
        try:
            resolved = self.resolver(scope)
        except Unidentified as exc:
            raise self._refused(exc.why) from None
        if resolved is not None and not isinstance(resolved, str):
            if inspect.isawaitable(resolved):  # (str first: isawaitable is an ABC)
                return self._awaited(resolved, allow_anonymous)
            raise self._refused(_not_a_tenant(resolved))
        if resolved:
            if not storable_tenant(resolved):
                raise self._refused(_UNSTORABLE)
            return resolved
        return "" if allow_anonymous else None

    async def _awaited(self, resolved: Awaitable[object], allow_anonymous: bool) -> str | None:
        try:
            tenant = await resolved
        except Unidentified as exc:
            raise self._refused(exc.why) from None
        if tenant is not None and not isinstance(tenant, str):
            raise self._refused(_not_a_tenant(tenant))
        if tenant:
            if not storable_tenant(tenant):
                raise self._refused(_UNSTORABLE)
            return tenant
        return "" if allow_anonymous else None

    async def refuse_named_late(self, scope: Scope) -> None:
        """For a request claimed as anonymous, before its outcome is recorded: raise
        `CallerNamedLate` if the resolver names a caller now (authentication ran inside the
        middleware, after the claim), or cannot say (it raises). Recorded, the response would
        be replayed to any caller with the same key."""
        named: object
        try:
            named = self.resolver(scope)
            if inspect.isawaitable(named):
                named = await named
        except Exception:
            named = True  # (a user it cannot name, or a resolver that fails now: not anonymous)
        if named:
            raise CallerNamedLate

    def _refused(self, why: str) -> RequestRejected:
        """No tenant can be trusted: the request is refused (500, logged once with why), never
        run unscoped."""
        if not self._refusal_logged:
            self._refusal_logged = True
            fix = (
                "give the user class a unique str identity, or pass tenant_resolver="
                if self._default
                else "make the tenant_resolver answer a str (or None for no caller)"
            )
            logger.error(
                "idempotency: no tenant: %s. Guarded requests are refused with 500 until it is "
                "fixed: %s",
                why,
                fix,
            )
        return RequestRejected(ProblemKind.MISCONFIGURED, _CANNOT_IDENTIFY)


#: The most bytes of UTF-8 a tenant may have: the record's primary key (tenant, operation, key)
#: is a btree entry, which PostgreSQL refuses past 2704 bytes (after compression), and a key is
#: up to 255. A longer tenant failed the claim (lease mode) or the completion (transactional,
#: after the handler ran) with the driver's error instead of being refused before the claim.
MAX_TENANT_BYTES = 1024

_UNSTORABLE = (
    f"the tenant resolver answered a str the store cannot hold (a NUL, an unpaired surrogate, "
    f"or over {MAX_TENANT_BYTES} bytes of UTF-8)"
)


def storable_tenant(tenant: str) -> bool:
    """Whether the store can key records by `tenant`: storable text, at most
    `MAX_TENANT_BYTES` bytes of UTF-8."""
    if tenant.isascii():
        return len(tenant) <= MAX_TENANT_BYTES and "\x00" not in tenant
    try:
        raw = tenant.encode()
    except UnicodeEncodeError:
        return False
    return len(raw) <= MAX_TENANT_BYTES and "\x00" not in tenant


def _not_a_tenant(answer: object) -> str:
    """Why a resolver's answer is refused, naming its type only: the value may be a credential
    (a resolver that returned the Authorization header's bytes) or personal data."""
    return f"the tenant resolver answered a {type(answer).__name__}, not a str or None"


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
    try:
        tenant = tenants.resolve(scope)
        if tenant is not None and not isinstance(tenant, str):
            tenant = await tenant
    except RequestRejected as exc:
        return problem_response(exc.kind, exc.detail, base=problem_base)
    except HTTPException as exc:  # the resolver's own 4xx, as the middleware answers it
        if not is_refusal(exc):
            raise
        challenge = tenants.challenge
        return refusal_response(
            exc, base=problem_base, challenge=challenge, source="tenant resolver"
        )
    if tenant is None:
        return problem_response(
            ProblemKind.UNAUTHENTICATED,
            "This resource needs authentication.",
            base=problem_base,
            challenge=tenants.challenge,
        )
    return tenant

"""Policies on endpoints: `@idempotent` and `@not_idempotent`, finding the policy an endpoint
carries (through `functools.partial`, and on an `HTTPEndpoint`'s method), and the refusal of a
decorated endpoint that no IdempotencyMiddleware guarded."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from contextvars import ContextVar
from enum import IntEnum
from typing import Any, TypeVar, Unpack

from starlette.endpoints import HTTPEndpoint
from starlette.requests import Request
from starlette.types import Scope

from .errors import ConfigurationError
from .options import PolicyOptions  # (at run time too: typing.get_type_hints reads it)
from .policy import Policy

POLICY_ATTRIBUTE = "__idempotency_policy__"
#: On a function `@idempotent` wrapped: the wrapper that carries its policy. A route registered
#: with the function itself (the decorator above `@app.post`) has no policy (see startup).
WRAPPER_ATTRIBUTE = "__idempotency_wrapper__"

#: The methods never guarded (RFC 9110's safe methods).
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})

#: How many `functools.partial` layers are looked through for an endpoint's policy.
_MAX_PARTIALS = 32


class Handled(IntEnum):
    """What an IdempotencyMiddleware did with the request it passed to the app (`HANDLED`)."""

    #: No IdempotencyMiddleware passed this request on.
    NO = 0
    #: Passed on unguarded by decision: the middleware switched off, a key optional and none
    #: sent, an outer middleware guarding it already. (A safe method is passed on with its
    #: scope instead: see `HANDLED`.)
    YES = 1
    #: Passed on because the route the middleware found (if any) has no guarding policy: an
    #: endpoint with one reached this way is one the middleware could not see.
    UNSEEN = 2


#: Set by IdempotencyMiddleware around a request it passes to the app unguarded; a guarded
#: request's endpoint runs under its claim's context instead. A decorated endpoint runs with
#: either `Handled.YES` or a claim's context, and refuses to run otherwise (see `idempotent`);
#: a request of a safe method (never guarded) is passed on with its scope as the middleware got
#: it, and runs a decorated endpoint while its method is still a safe one (`_method_changed`).
HANDLED: ContextVar[Handled | Scope] = ContextVar("idem_middleware.handled", default=Handled.NO)

F = TypeVar("F", bound=Callable[..., Any])


def endpoint_policy(endpoint: Any, method: str | None = None) -> Policy | None:
    """The policy `@idempotent` or `@not_idempotent` put on `endpoint`, looked for through
    `functools.partial` (as Starlette and FastAPI call the function inside); for an
    `HTTPEndpoint` class without one of its own, the policy on the method that serves `method`
    (as the class dispatches it). None: no policy."""
    policy = getattr(endpoint, POLICY_ATTRIBUTE, None)
    for _ in range(_MAX_PARTIALS):
        if policy is not None or not isinstance(endpoint, functools.partial):
            break
        endpoint = endpoint.func
        policy = getattr(endpoint, POLICY_ATTRIBUTE, None)
    if policy is None and method is not None and _endpoint_class(endpoint):
        policy = getattr(getattr(endpoint, method.lower(), None), POLICY_ATTRIBUTE, None)
    return policy if isinstance(policy, Policy) else None


def _endpoint_class(endpoint: Any) -> bool:
    return isinstance(endpoint, type) and issubclass(endpoint, HTTPEndpoint)


def idempotent(
    policy: Policy | None = None, /, **options: Unpack[PolicyOptions]
) -> Callable[[F], F]:
    """Attach a policy to an endpoint: `@idempotent(mode=Mode.LEASE)` or `@idempotent(policy)`.

    A guarded function endpoint is wrapped (signature, name and `__wrapped__` kept, as FastAPI
    needs) so that it refuses to run unless an IdempotencyMiddleware handles the request: without
    it the route would run unguarded without a word. Call `endpoint.__wrapped__` to run the
    handler itself (in a unit test, say).
    """
    if policy is not None and not isinstance(policy, Policy):
        # (`@idempotent` without parentheses made the endpoint this decorator, no policy on it)
        hint = ": write @idempotent() with its parentheses" if callable(policy) else ""
        raise ConfigurationError(f"idempotent() takes a Policy, not {policy!r}{hint}")
    if policy is not None and options:
        raise ConfigurationError("pass a Policy or keyword options, not both")
    chosen = policy if policy is not None else Policy(**options)

    def decorate(endpoint: F) -> F:
        if chosen.guard and inspect.isfunction(endpoint):
            wrapper = _require_middleware(endpoint)
            # (`functools.wraps` copied the endpoint's attributes: wrapped before, for another
            # app, its link to that app's wrapper, which this app's routes do not hold.)
            wrapper.__dict__.pop(WRAPPER_ATTRIBUTE, None)
            setattr(endpoint, WRAPPER_ATTRIBUTE, wrapper)
            endpoint = wrapper
        setattr(endpoint, POLICY_ATTRIBUTE, chosen)
        return endpoint

    return decorate


def _require_middleware(endpoint: F) -> F:
    from .context import current_context  # (context imports policy, as this module does)

    name = f"{endpoint.__module__}.{endpoint.__qualname__}"

    def refuse(handled: Handled | Scope) -> ConfigurationError:
        if not isinstance(handled, Handled):
            return ConfigurationError(
                f"{name} has an idempotency policy, but the IdempotencyMiddleware passed this "
                "request on as a safe method (GET, HEAD, OPTIONS or TRACE: never guarded), and a "
                "middleware inside it changed the method (a method override); it was not run, "
                "rather than run unguarded. Add that middleware outside the IdempotencyMiddleware."
            )
        if handled is Handled.UNSEEN:
            return ConfigurationError(
                f"{name} has an idempotency policy, but the IdempotencyMiddleware that passed "
                "this request on did not find it: the route that reached it is one the "
                "middleware cannot see into (an app mounted behind a wrapper, a router's "
                "default app) or names another endpoint; it was not run, rather than run "
                "unguarded. Add the middleware to the app whose router reaches the endpoint."
            )
        return ConfigurationError(
            f"{name} has an idempotency policy, but no IdempotencyMiddleware handled this "
            "request, so it would run unguarded; it was not run. Install the middleware "
            "(idem_middleware.fastapi.install(app, store=...), or "
            "app.add_middleware(IdempotencyMiddleware, store=...))."
        )

    if inspect.iscoroutinefunction(endpoint):

        @functools.wraps(endpoint)
        async def guarded_async(*args: Any, **kwargs: Any) -> Any:
            handled = HANDLED.get()
            if (
                handled is not Handled.YES
                and current_context() is None
                and (isinstance(handled, Handled) or _method_changed(handled, args, kwargs))
            ):
                raise refuse(handled)
            return await endpoint(*args, **kwargs)

        return _resolved_signature(guarded_async, endpoint)  # type: ignore[return-value]

    @functools.wraps(endpoint)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        handled = HANDLED.get()
        if (
            handled is not Handled.YES
            and current_context() is None
            and (isinstance(handled, Handled) or _method_changed(handled, args, kwargs))
        ):
            raise refuse(handled)
        return endpoint(*args, **kwargs)

    return _resolved_signature(guarded, endpoint)  # type: ignore[return-value]


def _method_changed(scope: Scope, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a request the middleware passed on as a safe method reaches the endpoint as
    another: its scope changed in place, or the endpoint's `Request` (a Starlette endpoint's
    argument, a FastAPI one's if it takes it) says so. (An override that copies the scope, before
    a FastAPI endpoint without a `Request`, cannot be seen: the startup check warns of it.)"""
    if scope.get("method") not in SAFE_METHODS:
        return True
    for value in (*args, *kwargs.values()):
        if isinstance(value, Request) and value.scope.get("method") not in SAFE_METHODS:
            return True
    return False


def _resolved_signature(wrapper: Callable[..., Any], endpoint: Any) -> Callable[..., Any]:
    """`wrapper`, with the endpoint's signature whose annotations written as strings (`from
    __future__ import annotations`) are resolved in the endpoint's module, as far as they can be
    now. FastAPI before 0.123.5 read the wrapper's signature (the endpoint's, through
    `__wrapped__`) but resolved its strings in the wrapper's module, this one: a body model and
    every dependency became a required query parameter, and each guarded request a 422."""
    try:
        signature = inspect.signature(endpoint)
        # (The function the strings were written in: through any decorator of another module
        # between, as `inspect.signature` and FastAPI go.)
        names = getattr(inspect.unwrap(endpoint), "__globals__", {})
    except Exception:  # (no signature to read: left to the framework, as it was)
        return wrapper

    def resolved(annotation: Any) -> Any:
        if not isinstance(annotation, str):
            return annotation
        try:
            return eval(annotation, names)  # (the app's own source, as typing evaluates it)
        except Exception:
            return annotation  # (defined later, say: left for the framework, as it was)

    parameters = [
        p.replace(annotation=resolved(p.annotation)) for p in signature.parameters.values()
    ]
    wrapper.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=parameters, return_annotation=resolved(signature.return_annotation)
    )
    return wrapper


def not_idempotent(endpoint: F) -> F:
    """Exempt one endpoint from guarding (a POST that is a query, say)."""
    setattr(endpoint, POLICY_ATTRIBUTE, Policy(guard=False))
    return endpoint

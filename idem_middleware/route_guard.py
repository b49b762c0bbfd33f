"""What guards a matched route, worked out once per route rather than once per path: the policy
(capped by the route's body limit) and the operation's name. An API with ids in its paths meets
a new path at almost every request, each a miss of the middleware's route cache; its routes are
few, and what they are guarded by depends on the route alone (its template, its endpoint and the
body limit in force), not on the path's parameters (the fingerprinter's: built per path)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, cast

from .body_limits import capped
from .endpoints import endpoint_policy
from .observe import shown
from .policy import Policy, RouteMatch, operation_name, pinned_method_error, storable_operation
from .route_cache import CACHED_KEY_LENGTH, ROUTE_CACHE_SIZE, UNGUARDED, UNNAMEABLE, Guarded

if TYPE_CHECKING:
    from .middleware import IdempotencyMiddleware
    from .routing import Unresolved

logger = logging.getLogger("idem_middleware")

#: A guarded route's policy (capped: body_limits.capped) and its operation's name.
Named = tuple[Policy, str]
#: Per (method, template, id of the endpoint, body limit in force): the route's `Named`, or the
#: route cache's `UNGUARDED` or `UNNAMEABLE` (the same objects: compared by identity), with the
#: endpoint itself, which the entry keeps alive: its id is no other object's while the entry is
#: kept. (By id: an endpoint need not be hashable.)
RouteGuards = dict[tuple[str, str, int, int | None], tuple[Named, Any]]


def route_guard(
    mw: IdempotencyMiddleware,
    method: str,
    match: RouteMatch,
    body_limit: int | None,
    key: tuple[str, str, int, int | None],
) -> Named | None:
    """What guards `method` on the route `match` found under `body_limit` (`key`: the four),
    kept in `mw._route_guards`; the route cache's `UNGUARDED` for a route the middleware
    passes on, its `UNNAMEABLE` for one whose operation no record can hold, None for a
    route refused (a pinned operation naming another method: logged at each request, never
    kept). Kept while the middleware's configuration is what it was, as the route cache keeps
    paths; not for a method and template longer than a cached path's key (any token is a
    method to a server, and a template made of the path a hidden mount took is the client's)."""
    operation = operation_name(method, match.template)
    policy = mw.policy_for(method, match, operation)
    named: Named
    if policy is None:
        named = cast(Named, UNGUARDED)
    elif policy.operation is not None:  # pinned (the startup check refused another method's)
        if error := pinned_method_error(method, match.template, policy):
            logger.error("idempotency: refused a request: %s", shown(error))
            return None
        named = capped(policy, body_limit), policy.operation
    elif not storable_operation(operation):  # (the client's method, a hidden mount's path)
        named = cast(Named, UNNAMEABLE)
    else:
        named = capped(policy, body_limit), operation
    guards = mw._route_guards
    if len(method) + len(match.template) <= CACHED_KEY_LENGTH:
        if len(guards) >= ROUTE_CACHE_SIZE:
            guards.clear()  # (routes of apps made at run time, each serving requests: start over)
        guards[key] = named, match.endpoint
    return named


def unresolved_guard(mw: IdempotencyMiddleware, method: str, match: Unresolved) -> Guarded | None:
    """A request that reaches a route the middleware cannot name: refused (None) when it would
    be guarded, else passed on (`UNGUARDED`)."""
    policy = endpoint_policy(match.endpoint, method)
    if policy is None and method in mw.methods:
        policy = mw.default_policy
    if policy is not None and policy.guard:
        logger.error(
            "idempotency: refused %s to %s: the middleware cannot name its route",
            shown(method),  # (any token a client sends, of any length)
            shown(match.where),
        )
        return None
    return UNGUARDED

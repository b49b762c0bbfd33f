"""What the library's own routes (the status resource, the token route) learn from the
middleware's startup check: the operations it guards, with their policies.

Neither route is guarded, and neither can see the middleware's configuration by itself (its
`policies` and `default_policy` live on the middleware). The check, which walks every route of
the app anyway, hands each of them the guarded operations it found: the token route then refuses
a token for an operation that takes none (no route, or one without `require_token`), and the
status resource says whether a retry of an `unknown` request can settle it (the route has a
reconciler). A route no middleware's check has seen knows nothing, and refuses nothing for it.

The check hands them the middleware's `problem_base` too: a route built without one answers its
problems under the base of the middleware that saw it (the default until one has), so that one
API speaks one problem vocabulary. A route given another base than that middleware's, or seen by
two middlewares with different bases, fails the check (see `GuardedOperations.learn_base`).
"""

from __future__ import annotations

import difflib
import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from .errors import ConfigurationError, ProblemKind
from .middleware_arguments import check_problem_base
from .observe import shown
from .policy import Policy
from .responses import DEFAULT_PROBLEM_BASE, problem_response

logger = logging.getLogger("idem_middleware")

#: Set on the endpoints of the library's own routes to their `GuardedOperations`.
ROUTE_OPERATIONS_ATTRIBUTE = "__idem_guarded_operations__"


class GuardedOperations:
    """The operations guarded around one library route, by name (`METHOD /template`); None until
    a middleware's startup check has seen the route. Filled once per middleware (several
    middlewares that each see the route add up), never changed by a request."""

    __slots__ = ("_learned", "given_base", "kind", "policies", "store")

    def __init__(self, kind: str, problem_base: str | None = None, store: Any = None) -> None:
        if problem_base is not None:  # (checked as the middleware's: answered under it)
            check_problem_base(problem_base)
        self.kind = kind  # "status" or "tokens", for the startup log
        self.store = store  # what the route reads (or issues tokens through)
        self.policies: Mapping[str, Policy] | None = None
        self.given_base = problem_base  # the route's own `problem_base` (None: the middleware's)
        self._learned: str | None = None  # the base of the first middleware that saw it

    @property
    def base(self) -> str:
        """The base the route's problems go under: its own, else that of the middleware that
        saw it, else the default."""
        if self.given_base is not None:
            return self.given_base
        return DEFAULT_PROBLEM_BASE if self._learned is None else self._learned

    def learn_base(self, base: str, where: str) -> str | None:
        """Take the base of a middleware whose check saw the route (at `where`); the error when
        the route cannot answer under it: it was given another, or another middleware that saw
        it has another (its problems would not be that middleware's)."""
        route = f"the {self.kind} route at {where}"
        if self.given_base is not None:
            if self.given_base == base:
                return None
            return (
                f"{route} was given problem_base={self.given_base!r}, but the "
                f"IdempotencyMiddleware in front of it has problem_base={base!r}: one API would "
                f"answer problems of two vocabularies. Give the route the middleware's base, or "
                f"none (it then answers under the middleware's)"
            )
        if self._learned is None:
            self._learned = base
        elif self._learned != base:
            return (
                f"{route} has no problem_base of its own and is seen by two "
                f"IdempotencyMiddlewares with different ones, {self._learned!r} and {base!r}: it "
                f"cannot answer under both. Give the middlewares one problem_base (or mount the "
                f"route where only one of them sees it)"
            )
        return None

    def learn(self, guarded: Iterable[tuple[str, Policy]]) -> None:
        merged = dict(self.policies or {})
        for name, policy in guarded:
            merged.setdefault(name, policy)
        self.policies = MappingProxyType(merged)

    def policy(self, operation: str) -> Policy | None:
        return None if self.policies is None else self.policies.get(operation)

    def takes_tokens(self, operation: str) -> str | None:
        """None when `operation` may be issued a token (or nothing is known); otherwise why not,
        with the nearest operation that takes tokens, for a typo."""
        if self.policies is None:
            return None
        policy = self.policies.get(operation)
        if policy is not None and policy.require_token:
            return None
        takers = self.token_operations()
        if not takers:
            return "No operation of this server takes tokens (require_token)."
        close = difflib.get_close_matches(operation, takers, n=1, cutoff=0.5)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        what = "takes no token" if policy is not None else "is no guarded operation of this server"
        return (
            f"The operation {what}; tokens are issued for the operations with require_token,"
            f" named `METHOD /path-template` as the route declares it.{hint}"
        )

    def token_operations(self) -> list[str]:
        return sorted(name for name, p in (self.policies or {}).items() if p.require_token)


def shared_names(guarded: Sequence[tuple[str, Policy]]) -> list[str]:
    """Warn for every name that more than one guarded route has: they share one key space (a
    key used on one replays its response to the others). The errors: names whose routes differ
    in what the status and token routes and the CLI read of an operation's policy (its mode,
    what a lapsed lease becomes, its reconciler, `require_token`), since they read one."""
    errors = []
    for name, count in sorted(Counter(name for name, _ in guarded).items()):
        if count < 2:
            continue
        policies = [policy for named, policy in guarded if named == name]
        logger.warning(  # (routes told apart by more than their path: a version header, say)
            "idempotency: %s names more than one guarded route: they share one key space, and a "
            "key used on one replays its response to the others%s",
            shown(name),
            " (as while a renamed route is served at both paths)"
            if any(policy.operation is not None for policy in policies)
            else "",
        )
        first = policies[0]
        # (Reconcilers compared by `==`: a bound method, `bank.ask`, is a new object each time.)
        if any(_read(policy) != _read(first) for policy in policies[1:]):
            errors.append(
                f"the {count} guarded routes named {shown(name)} differ in mode, "
                "on_lease_expiry, reconciler or require_token: they share one record per key, "
                "and the status and token routes and the CLI read one policy per operation. "
                "Give them the same"
            )
    return errors


def _read(policy: Policy) -> tuple[Any, ...]:
    return (policy.mode, policy.on_lease_expiry, policy.reconciler, policy.require_token)


def tell_library_routes(
    items: Iterable[Any], guarded: Iterable[tuple[str, Policy]], problem_base: str, store: Any
) -> list[str]:
    """Give every library route among `items` (the routes startup walked) the operations the
    middleware guards and its `problem_base`; warn for a token route when no operation takes
    tokens, and for a route on another store than the middleware's (`store`). The errors: the
    routes that cannot answer under the middleware's base."""
    guarded = list(guarded)
    errors: list[str] = []
    for item in items:
        operations = getattr(getattr(item, "endpoint", None), ROUTE_OPERATIONS_ATTRIBUTE, None)
        if not isinstance(operations, GuardedOperations):
            continue
        operations.learn(guarded)
        if (error := operations.learn_base(problem_base, item.template)) is not None:
            errors.append(error)
        if operations.store is not None and not same_records(operations.store, store):
            # (Found by probing: every status a 404, every token issued refused at its use.)
            logger.warning(
                "idempotency: the %s route %s was given another store than the "
                "IdempotencyMiddleware in front of it (%s, the middleware's %s): unless both "
                "reach one database, it %s. Give it the middleware's store",
                operations.kind,
                item.template,
                type(operations.store).__name__,
                type(store).__name__,
                "finds none of the records the middleware keeps"
                if operations.kind == "status"
                else "issues tokens the middleware never finds",
            )
        if operations.kind == "tokens" and not operations.token_operations():
            logger.warning(
                "idempotency: the token route %s issues tokens for the operations with "
                "require_token=True, and no guarded operation has it: every request to it is "
                "refused (400)",
                item.template,
            )
    return errors


def same_records(one: Any, other: Any) -> bool:
    """Whether two stores keep the same records, as far as can be told: one store, or two
    PostgresStores on one pool or one DSN (an app's and a route's, made apart, are common)."""
    if one is other:
        return True
    if type(one) is not type(other):
        return False
    pools = getattr(one, "_pool", None), getattr(other, "_pool", None)
    dsns = getattr(one, "_dsn", None), getattr(other, "_dsn", None)
    return (pools[0] is not None and pools[0] is pools[1]) or (
        dsns[0] is not None and dsns[0] == dsns[1]
    )


class LibraryRoute(Route):
    """A library route: a method it does not serve is `405 method-not-allowed` with `Allow`, in
    problem+json as the library answers everything (Starlette's own 405 is plain text, or
    whatever the app's handler of HTTPException makes of it), under the route's base."""

    def __init__(self, path: str, endpoint: Any, *, method: str, name: str) -> None:
        if not isinstance(path, str) or not path.startswith("/"):  # (Starlette's bare assert)
            raise ConfigurationError(f"the {name} route's path starts with '/', not {path!r:.60}")
        super().__init__(path, endpoint, methods=[method], name=name)
        operations = getattr(endpoint, ROUTE_OPERATIONS_ATTRIBUTE, None)
        if not isinstance(operations, GuardedOperations):
            raise TypeError("a LibraryRoute's endpoint carries its GuardedOperations")
        self.operations = operations

    @property
    def problem_base(self) -> str:
        """The base its problems are answered under (see `GuardedOperations.base`)."""
        return self.operations.base

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.methods and scope["method"] not in self.methods:
            allow = ", ".join(sorted(self.methods))
            detail = f"This resource answers {allow} only."
            response = problem_response(
                ProblemKind.METHOD_NOT_ALLOWED, detail, base=self.problem_base
            )
            response.headers["allow"] = allow
            response.headers["cache-control"] = "no-store"  # (as every answer of theirs)
            await response(scope, receive, send)
            return
        await super().handle(scope, receive, send)

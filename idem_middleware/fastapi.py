"""FastAPI wiring: dependencies that hand a handler its claim's connection and context."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Annotated, Any, TypeAlias, Unpack

import asyncpg

try:
    from fastapi import Depends, FastAPI, Request
except ModuleNotFoundError as exc:  # installed without the extra
    from .errors import missing_extra

    raise missing_extra(__name__, "fastapi", exc) from exc
from starlette.routing import Host, Mount

from .context import IdempotencyContext, get_context
from .endpoints import idempotent, not_idempotent
from .errors import NO_CLAIM_HINT, ConfigurationError
from .middleware import IdempotencyMiddleware
from .openapi import document_openapi
from .ops import GuardedOperation, find_middleware, guarded_operations
from .options import MiddlewareOptions  # (at run time too: typing.get_type_hints reads it)
from .routing import Found, listed_routes, mounted_app, walk
from .store.base import Store

if TYPE_CHECKING:
    Connection: TypeAlias = asyncpg.Connection[Any]
else:  # asyncpg's Connection is generic only in its type stubs
    Connection = asyncpg.Connection

_MAX_DEPTH = 32
#: The apps install() added the middleware to.
_INSTALLED: weakref.WeakSet[Any] = weakref.WeakSet()

__all__ = [
    "Idempotency",
    "IdempotencyConnection",
    "document",
    "idempotency_context",
    "idempotent",
    "install",
    "not_idempotent",
    "transaction_connection",
]


# Dependencies are `async def` on purpose: FastAPI runs a plain `def` dependency in a worker
# thread, a hop that costs more than everything these do.
async def idempotency_context(request: Request) -> IdempotencyContext:
    return _claimed(request)


def _claimed(request: Request) -> IdempotencyContext:
    try:
        return get_context(request)
    except LookupError:
        raise RuntimeError(
            "this endpoint depends on an idempotency claim, but none is active: " + NO_CLAIM_HINT
        ) from None


async def transaction_connection(request: Request) -> Connection:
    # Reads the request itself rather than depending on `idempotency_context`: one dependency
    # to solve instead of two, on every request.
    context = _claimed(request)
    if context.connection is None:
        raise RuntimeError("this claim has no database connection (an in-memory store?)")
    connection: Connection = context.connection
    return connection


#: The idempotency context of the running request (key, generation, downstream key, declare()).
Idempotency = Annotated[IdempotencyContext, Depends(idempotency_context)]
#: The connection whose transaction commits together with the request's idempotency outcome.
IdempotencyConnection = Annotated[Connection, Depends(transaction_connection)]


def document(app: FastAPI) -> None:
    """Document every guarded operation in `app.openapi()`: the Idempotency-Key header, the
    problem responses (RFC 9457) and the replay header; and in the OpenAPI of each FastAPI app
    mounted in `app` (its own `/docs`), for the operations `app`'s middleware guards there.
    Idempotent; `install` calls it. An app that replaces `app.openapi` afterwards calls it
    again."""
    _document_mounted(app)
    documented = getattr(app.openapi, "__idem_documented__", None)
    if documented == "own":
        return
    if documented == "mounted":  # by a parent's middleware, before it had one of its own
        if find_middleware(app) is None:  # (none yet: the parent's additions are the ones)
            return
        app.openapi = app.openapi.__wrapped__  # type: ignore[attr-defined,method-assign]
    _wrap_openapi(app, lambda schema: _document(schema, app, app), "own")
    # A sub-app mounted after `install` is documented as it is mounted (`app.mount`,
    # `app.host`), and, one added to a route list by hand, once every route is there: when the
    # app first runs (lifespan or first request), whether or not the server sends lifespan.
    build = app.build_middleware_stack

    def build_and_document() -> Any:
        _document_mounted(app)
        return build()

    app.build_middleware_stack = build_and_document  # type: ignore[method-assign]
    for name in ("mount", "host"):
        add = getattr(app.router, name)
        if not getattr(add, "__idem_documented__", False):
            setattr(app.router, name, _documenting(app, add))


def _documenting(app: FastAPI, add: Callable[..., None]) -> Callable[..., None]:
    def adding(*args: Any, **kwargs: Any) -> None:
        add(*args, **kwargs)
        _document_mounted(app)

    adding.__idem_documented__ = True  # type: ignore[attr-defined]
    return adding


def _wrap_openapi(app: FastAPI, add: Callable[[dict[str, Any]], dict[str, Any]], by: str) -> None:
    original = app.openapi
    app.openapi_schema = None  # a schema cached before now has none of the additions

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = add(original())
        return app.openapi_schema

    openapi.__idem_documented__ = by  # type: ignore[attr-defined]
    openapi.__wrapped__ = original  # type: ignore[attr-defined]
    app.openapi = openapi  # type: ignore[method-assign]


def _document(schema: dict[str, Any], app: FastAPI, of: FastAPI) -> dict[str, Any]:
    return document_openapi(schema, app, operations=_operations(app, of))


def _document_mounted(app: FastAPI) -> None:
    """Wrap the `openapi` of each FastAPI app mounted (at any depth) in `app` and served by its
    middleware; one with an IdempotencyMiddleware of its own is documented by its own."""
    for sub, _ in _mounted(listed_routes(app) or (), "", 0):
        if getattr(sub.openapi, "__idem_documented__", False) or find_middleware(sub):
            continue

        def add(schema: dict[str, Any], sub: FastAPI = sub) -> dict[str, Any]:
            return _document(schema, app, sub)

        _wrap_openapi(sub, add, "mounted")


def _mounted(routes: Sequence[Any], prefix: str, depth: int) -> Iterator[tuple[FastAPI, str]]:
    """Each FastAPI app mounted among `routes`, with the template its routes start with there
    (as routing.walk names them: a Host's with its host)."""
    for route in routes:
        if not isinstance(route, Mount | Host) or depth >= _MAX_DEPTH:
            continue
        at = prefix + route.path if isinstance(route, Mount) else route.host + prefix
        if isinstance(mounted := mounted_app(route), FastAPI):
            yield mounted, at
        yield from _mounted(listed_routes(mounted) or (), at, depth + 1)


def _operations(app: FastAPI, of: FastAPI) -> list[tuple[GuardedOperation, str]]:
    """The guarded operations of `app` that `of.openapi()` lists (`of`: `app` or an app mounted
    in it), each with its path there. FastAPI lists the app's own routes, not its mounts' (their
    apps serve their own), at paths without the prefix of where `of` is mounted: an operation
    is `of`'s when its template is that of one of `of`'s own routes as mounted there (picked
    by path prefix, another `Host`'s route with the same path was taken for one of `of`'s)."""
    places = (
        [""]
        if of is app
        else [at for sub, at in _mounted(listed_routes(app) or (), "", 0) if sub is of]
    )
    own = [route for route in of.routes if not isinstance(route, Mount | Host)]
    paths: dict[tuple[str, str], str] = {}
    for item in walk(own):
        if isinstance(item, Found):
            for at, method in itertools.product(places, item.methods or ("*",)):
                paths.setdefault((at + item.template, method), item.path_format)
    found: dict[tuple[str, str], tuple[GuardedOperation, str]] = {}
    for op in guarded_operations(app):
        path = paths.get((op.template, op.method), paths.get((op.template, "*")))
        if path is not None:  # (the first where `of` is mounted twice)
            found.setdefault((path, op.method), (op, path))
    return list(found.values())


def install(app: FastAPI, *, store: Store, **options: Unpack[MiddlewareOptions]) -> None:
    """Add IdempotencyMiddleware to `app` (inside any authentication middleware added after it)
    and document it in OpenAPI. `options` are the middleware's keyword arguments."""
    if not isinstance(app, FastAPI):  # (a Starlette app failed on `openapi`, half installed)
        raise ConfigurationError(
            f"install() is for a FastAPI app, not a {type(app).__name__}: add the middleware "
            "with app.add_middleware(IdempotencyMiddleware, store=store, ...)"
        )
    # The app builds its middleware at its first call, the lifespan's: an option refused then
    # was taken by uvicorn for a lifespan the app does not support, and every request failed.
    IdempotencyMiddleware(_never_called, store=store, **options)  # checked now, as made
    if app in _INSTALLED:  # (the outer one would guard every request, the other never used)
        raise ConfigurationError("install() was called on this app already: call it once")
    app.add_middleware(IdempotencyMiddleware, store=store, **options)
    _INSTALLED.add(app)
    document(app)


async def _never_called(scope: Any, receive: Any, send: Any) -> None:  # pragma: no cover
    raise AssertionError("install()'s check of its options serves nothing")

"""The tenant resolution every edge shares: sync or async resolvers, anonymous callers, and a
scope no authentication ran for."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.authentication import (
    AuthCredentials,
    AuthenticationBackend,
    BaseUser,
    SimpleUser,
    UnauthenticatedUser,
)
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_middleware import IdempotencyMiddleware, MemoryStore
from idem_middleware.errors import ProblemKind, RequestRejected
from idem_middleware.middleware import TenantResolver, authenticated_user_tenant
from idem_middleware.tenant import Tenants
from tests.apps import assert_problem, client, key


async def resolve(tenants: Tenants, scope: dict[str, Any], **options: bool) -> str | None:
    """As the edges call it: what is neither a str nor None is awaited."""
    tenant = tenants.resolve(scope, **options)
    if tenant is None or isinstance(tenant, str):
        return tenant
    return await tenant


async def test_sync_and_async_resolvers_give_the_same_tenant() -> None:
    async def async_resolver(scope: object) -> str:
        return "tenant-a"

    for resolver in (lambda scope: "tenant-a", async_resolver):
        assert await resolve(Tenants(resolver), {}) == "tenant-a"


def test_a_synchronous_resolver_is_answered_without_a_coroutine() -> None:
    assert Tenants(lambda scope: "tenant-a").resolve({}) == "tenant-a"
    assert Tenants(lambda scope: None).resolve({}) is None
    assert Tenants(lambda scope: None).resolve({}, allow_anonymous=True) == ""


@pytest.mark.parametrize("resolved", [None, ""])
@pytest.mark.parametrize("asynchronous", [False, True])
async def test_no_tenant_is_a_refusal_unless_anonymous_callers_are_allowed(
    resolved: str | None, asynchronous: bool
) -> None:
    async def async_resolver(scope: object) -> str | None:
        return resolved

    tenants = Tenants(async_resolver if asynchronous else lambda scope: resolved)
    assert await resolve(tenants, {}) is None
    assert await resolve(tenants, {}, allow_anonymous=True) == ""


async def test_the_default_reads_the_authenticated_user() -> None:
    tenants = Tenants()
    assert await resolve(tenants, {"user": SimpleUser("tenant-b")}) == "tenant-b"
    assert await resolve(tenants, {"user": UnauthenticatedUser()}) is None


def test_a_scope_without_a_user_is_unidentifiable_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tenants = Tenants(authenticated_user_tenant)
    with caplog.at_level(logging.ERROR, logger="idem_middleware"):
        assert tenants.unidentifiable({})
        assert tenants.unidentifiable({})
    assert len([r for r in caplog.records if "no 'user'" in r.getMessage()]) == 1
    assert not tenants.unidentifiable({"user": UnauthenticatedUser()})  # a 401, not a 500
    assert not tenants.unidentifiable({}, allow_anonymous=True)
    custom: TenantResolver = lambda scope: None  # noqa: E731
    assert not Tenants(custom).unidentifiable({})  # a custom resolver reads what it reads


class NamedOnly(BaseUser):
    """An authenticated user class with a display name and no identity."""

    def __init__(self, name: str) -> None:
        self.name = name

    @property
    def is_authenticated(self) -> bool:
        return True

    @property
    def display_name(self) -> str:
        return self.name


class WithIdentity(SimpleUser):
    def __init__(self, identity: object) -> None:
        super().__init__("shown")
        self._identity = identity

    @property
    def identity(self) -> Any:
        return self._identity


class OwnUser:
    """A user class of the app's own, not a BaseUser: no `identity` at all."""

    is_authenticated = True


class Abstract(BaseUser):
    """A BaseUser that leaves is_authenticated to subclasses (NotImplementedError)."""

    @property
    def identity(self) -> str:
        return "someone"


class MethodUser(BaseUser):
    """`is_authenticated` written as a method: a bound method is true, for everyone."""

    def is_authenticated(self) -> bool:  # type: ignore[override]
        return False

    @property
    def identity(self) -> str:
        return "nobody"


@pytest.mark.parametrize(
    "user",
    [
        NamedOnly("Alice"),
        WithIdentity(None),
        WithIdentity(True),
        WithIdentity(b"tenant"),
        OwnUser(),
        {"id": "alice"},
        MethodUser(),
        Abstract(),
    ],
    ids=[
        "no-identity",
        "identity-none",
        "identity-bool",
        "identity-bytes",
        "not-a-base-user",
        "a-dict",
        "is-authenticated-a-method",
        "is-authenticated-not-implemented",
    ],
)
@pytest.mark.parametrize("allow_anonymous", [False, True])
async def test_a_user_the_default_cannot_name_is_refused_not_shared(
    user: Any, allow_anonymous: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by probing: a user class without `identity` fell back to its display name (two
    users called Alice shared records and replays), and an identity of None became "None".
    Later: a user the app's own middleware set (a dict, a class with no `identity`: an
    AttributeError, a bare 500) was taken for anonymous, so on a route open to anonymous
    callers two users shared the key space ""; and an `is_authenticated` written as a method
    (true, bound) named every caller who was no one."""
    tenants = Tenants()
    for _ in range(2):
        with pytest.raises(RequestRejected) as refused:
            await resolve(tenants, {"user": user}, allow_anonymous=allow_anonymous)
        assert refused.value.kind is ProblemKind.MISCONFIGURED
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "give the user class a unique str identity, or pass tenant_resolver=" in errors[0]


def test_simple_user_is_its_username_on_a_starlette_before_1_7(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Starlette gave SimpleUser an identity (its username) in 1.7 only; before, the README's
    and the guides' apps (SimpleUser(tenant), the default resolver) refused every guarded
    request with 500 server-misconfigured, though pyproject allows starlette>=0.37."""
    monkeypatch.delattr(SimpleUser, "identity")  # BaseUser's: NotImplementedError, as before 1.7
    scope = {"user": SimpleUser("tenant-a")}
    assert authenticated_user_tenant(scope) == "tenant-a"

    class Named(SimpleUser):  # a subclass may mean something else by its username
        pass

    with pytest.raises(RequestRejected):
        authenticated_user_tenant({"user": Named("x")})


async def test_an_integer_identity_is_its_digits() -> None:
    assert await resolve(Tenants(), {"user": WithIdentity(42)}) == "42"
    assert await resolve(Tenants(), {"user": WithIdentity("")}) is None  # no one: 401


@pytest.mark.parametrize("answer", [42, b"tenant", ["tenant"], object()])
@pytest.mark.parametrize("asynchronous", [False, True])
async def test_a_resolver_answering_neither_a_str_nor_none_is_refused(
    answer: object, asynchronous: bool
) -> None:
    async def async_resolver(scope: object) -> object:
        return answer

    tenants = Tenants(async_resolver if asynchronous else lambda scope: answer)  # type: ignore[arg-type,return-value]
    with pytest.raises(RequestRejected) as refused:
        await resolve(tenants, {})
    assert refused.value.kind is ProblemKind.MISCONFIGURED


@pytest.mark.parametrize("asynchronous", [False, True])
async def test_a_refused_resolver_answer_is_logged_by_its_type_not_its_value(
    asynchronous: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by probing: a resolver that returned the Authorization header's bytes (instead of
    decoding them) had the bearer token written into the error log with the answer's repr."""
    credential = b"Bearer sk_live_do_not_log"

    async def async_resolver(scope: object) -> object:
        return credential

    tenants = Tenants(async_resolver if asynchronous else lambda scope: credential)  # type: ignore[arg-type,return-value]
    with (
        caplog.at_level(logging.DEBUG, logger="idem_middleware"),
        pytest.raises(RequestRejected) as refused,
    ):
        await resolve(tenants, {})
    logged = [r.getMessage() for r in caplog.records]
    assert any("answered a bytes, not a str or None" in text for text in logged), logged
    assert not any("sk_live" in text for text in [*logged, str(refused.value)])
    # The fix named is the resolver's (it named the user class, which the app may not have).
    assert any("make the tenant_resolver answer a str" in text for text in logged), logged
    assert not any("user class" in text for text in logged), logged


async def test_two_users_without_identities_never_share_a_replay() -> None:
    """End to end: the second Alice gets a 500 problem, not the first Alice's response."""
    calls: list[str] = []

    async def pay(request: Request) -> Response:
        calls.append("ran")
        return JSONResponse({"secret": 1}, status_code=201)

    class NamedOnlyBackend(AuthenticationBackend):
        async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, BaseUser]:
            return AuthCredentials(["authenticated"]), NamedOnly("Alice")

    app = Starlette(
        routes=[Route("/pay", pay, methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=NamedOnlyBackend()),
            Middleware(IdempotencyMiddleware, store=MemoryStore()),
        ],
    )
    async with client(app) as http:
        for _ in range(2):
            reply = await http.post("/pay", json={}, headers=key("k"))
            assert_problem(reply, 500, "server-misconfigured")
    assert calls == []

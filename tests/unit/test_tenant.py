"""The tenant resolution every edge shares: sync or async resolvers, anonymous callers, and a
scope no authentication ran for."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from starlette.authentication import SimpleUser, UnauthenticatedUser

from idem_middleware.middleware import TenantResolver, authenticated_user_tenant
from idem_middleware.tenant import Tenants


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

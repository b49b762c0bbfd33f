"""Pinned: text that is not ASCII is refused for a NUL just as ASCII text is
(storable.storable_text, its non-ASCII branch): a job's key or tenant, or a job's operation,
holding a NUL after a non-ASCII character is a ValueError before any claim, on either store (on
the in-memory one it used to run, and on PostgreSQL reach the driver as its own error)."""

from __future__ import annotations

from typing import Any

import pytest

from idem_middleware import IdempotencyContext, MemoryStore
from idem_middleware.errors import ConfigurationError
from idem_middleware.jobs import idempotent_job
from idem_middleware.storable import storable_text


@pytest.mark.parametrize("text", ["caf\u00e9\x00", "\x00\u652f", "\u00e9\x00\u00e9"])
def test_non_ascii_text_with_a_nul_is_not_storable(text: str) -> None:
    assert not storable_text(text)
    assert storable_text(text.replace("\x00", ""))


async def test_a_jobs_non_ascii_key_or_tenant_with_a_nul_is_refused_before_the_claim() -> None:
    runs: list[Any] = []
    store = MemoryStore()

    @idempotent_job(store, operation="send", key="k", tenant=lambda **kw: kw["account"])
    async def send(ctx: IdempotencyContext, *, k: Any, account: Any) -> int:
        runs.append(k)
        return len(runs)

    for k, account in (("caf\u00e9\x00", "a"), ("k1", "\u00e9\x00")):
        with pytest.raises(ValueError, match="NUL"):
            await send(k=k, account=account)
    assert runs == []
    assert await send(k="caf\u00e9", account="\u00e9") == 1


def test_a_jobs_non_ascii_operation_with_a_nul_is_refused() -> None:
    with pytest.raises((ConfigurationError, ValueError)):

        @idempotent_job(MemoryStore(), operation="caf\u00e9\x00", key="k")
        async def send(ctx: IdempotencyContext, *, k: str) -> None: ...

"""A lease-mode record whose executor stopped: pending, its lease lapsed (for store_edges)."""

from __future__ import annotations

from typing import Any

import asyncpg
import httpx

from idem_middleware import PostgresStore
from idem_middleware.store.base import RecordKey
from tests.apps import key


async def lapsed_record(
    c: httpx.AsyncClient, store: PostgresStore, admin: asyncpg.Connection[Any], name: str
) -> None:
    """`POST /pay {}` of tenant-a under key `name`, claimed in lease mode and left pending with
    its lease lapsed. (A first request under `name-0` gives the body's fingerprint: a key is not
    part of it.)"""
    assert (await c.post("/pay", json={}, headers=key(f"{name}-0"))).status_code == 201
    fingerprint = await admin.fetchval(
        "SELECT fingerprint FROM idem_requests WHERE idem_key = $1", f"{name}-0"
    )
    await store.claim_lease(
        RecordKey("tenant-a", "POST /pay", name), fingerprint,
        retention_seconds=60, lease_seconds=30,
    )  # fmt: skip
    await admin.execute(
        "UPDATE idem_requests SET lease_expires_at = now() - interval '1 second'"
        " WHERE idem_key = $1",
        name,
    )

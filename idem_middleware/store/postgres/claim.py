"""The ordinary claim: a parameterised `claim`, and what to do when it returns nothing."""

from __future__ import annotations

from typing import Any

from ...errors import ClaimTimeout
from ..base import Claim, RecordKey
from .convert import _Q, to_record, token_problem

# How often a claim re-reads a record that vanished between the INSERT and the SELECT (a
# concurrent claim rolled back, or a purge ran). Each pass makes progress, so a few suffice.
_CLAIM_ATTEMPTS = 4


async def claim(
    executor: Any,
    key: RecordKey,
    args: tuple[Any, ...],
    token_hash: bytes | None,
    timeout: float | None,  # noqa: ASYNC109 - asyncpg's own per-statement timeout
) -> Claim:
    """Claim, or return the record holding the key (see queries.sql `claim`).

    `executor` is the claim's connection (transactional mode) or the pool (lease mode: each
    statement commits on its own). With `token_hash`, only a live issued token may be claimed;
    `Claim(False, 0, None)` means the token was refused.
    """
    for _ in range(_CLAIM_ATTEMPTS):
        rows = await executor.fetch(_Q["claim"], *args, token_hash, timeout=timeout)
        if rows:
            row = rows[0]
            if row["claimed"]:
                return Claim(True, row["generation"], None, row["epoch"])
        else:
            # The conflicting claim committed after our snapshot: read it afresh.
            row = await executor.fetchrow(_Q["get"], *args[:3], timeout=timeout)
            if row is None:
                # Gone again (released, or purged). A token claim finds out whether the token
                # itself was refused, or only met that claim, and then claims again.
                if token_hash is not None and await _token_refused(
                    executor, key, token_hash, args[3], timeout
                ):
                    return Claim(False, 0, None)
                continue
        record = to_record(key, row)
        if not record.expired:
            return Claim(False, record.generation, record)
        if token_hash is not None and await _token_refused(
            executor, key, token_hash, args[3], timeout
        ):
            return Claim(False, 0, None)
        reclaimed = await executor.fetchrow(
            _Q["reclaim_expired"], *args, token_hash, timeout=timeout
        )
        if reclaimed is not None:
            return Claim(True, reclaimed["generation"], None, reclaimed["epoch"])
    raise ClaimTimeout("the record kept changing under the claim")


async def _token_refused(
    executor: Any,
    key: RecordKey,
    token_hash: bytes,
    fingerprint: bytes,
    timeout: float | None,  # noqa: ASYNC109 - asyncpg's own per-statement timeout
) -> bool:
    status = await executor.fetchrow(
        _Q["token_status"], key.tenant, token_hash, key.operation, fingerprint, timeout=timeout
    )
    return bool(token_problem(status))

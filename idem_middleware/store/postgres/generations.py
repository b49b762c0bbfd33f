"""Generations drawn ahead for the transactional fast path's claims."""

from __future__ import annotations

import time
from collections import deque
from operator import itemgetter
from typing import Any

from .convert import _Q


class Generations:
    """Generations drawn from `idem_generation_seq` ahead of use, for the fused claim (a simple
    query returns no rows, so the claim cannot RETURNING its generation).

    Each drawn value is handed out at most once, so generations are still never reused; values
    older than `max_age` are dropped, so generations keep roughly the order of the claims.
    """

    def __init__(self, batch: int = 32, max_age: float = 1.0) -> None:
        self._batch = batch
        self._max_age = max_age
        self._values: deque[int] = deque()
        self._drawn_at = 0.0

    def take_ready(self) -> int | None:
        """A drawn generation, or None: then `draw` (inside the claim's transaction)."""
        if self._values and time.monotonic() - self._drawn_at <= self._max_age:
            return self._values.popleft()
        return None

    async def draw(self, conn: Any, timeout: float | None = None) -> int:  # noqa: ASYNC109
        """Draw a batch (in the caller's transaction, so it costs no commit of its own) and
        take one, within `timeout` seconds. A concurrent draw may replace the batch; each value
        is still taken once."""
        rows = await conn.fetch(_Q["draw_generations"], self._batch, timeout=timeout)
        values = self._values = deque(map(itemgetter(0), rows))
        self._drawn_at = time.monotonic()
        return values.popleft()

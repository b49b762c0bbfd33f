"""Lease mode's fenced transaction: the handler's writes, committed with the settlement of the
generation that fenced the record (in one message on the fast path, see fused.py)."""

from __future__ import annotations

from typing import Any

from ..base import RecordKey, Settlement, State
from .convert import _Q, TRANSLATED, settle_args, translate
from .fused import FastPath


class PgFenced:
    __slots__ = ("_conn", "_expected", "_fast", "_generation", "_key", "_tx", "committed")

    def __init__(
        self,
        conn: Any,
        tx: Any,
        fast: FastPath | None,
        key: RecordKey,
        generation: int,
        expected: State,
    ) -> None:
        self._conn = conn
        self._tx = tx
        self._fast = fast  # set when the fence was opened the fast way (an adopted BEGIN)
        self._key = key
        self._generation = generation
        self._expected = expected
        self.committed = False

    @property
    def connection(self) -> Any:
        return self._conn

    async def settle(self, s: Settlement) -> bool:
        args = settle_args(self._key, self._generation, self._expected, s)
        if self._fast is not None:
            body = b"" if s.response is None else s.response.body
            try:
                done = await self._fast.settle_and_commit(self._conn, self._tx, args, len(body))
            except TRANSLATED as exc:
                raise translate(exc) from exc
            if done:
                self.committed = True
                return True
        try:
            row = await self._conn.fetchrow(_Q["settle"], *args)
            if not row["settled"]:
                return False  # the session's end rolls back
            await self._tx.commit()
        except TRANSLATED as exc:
            raise translate(exc) from exc
        self.committed = True
        return True

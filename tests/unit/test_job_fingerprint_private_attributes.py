"""A job's fingerprint is its arguments as orjson writes them, and orjson leaves out a
dataclass's attributes whose names start with "_": two calls that differed only there shared a
fingerprint, so the second, with the same key, got the first one's stored result instead of
JobKeyReused (the wrong result replayed). Such arguments are refused at the call, before the
claim (ConfigurationError), as NaN is; found by probing the fingerprints."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import pytest

from idem_middleware import ConfigurationError, IdempotencyContext, MemoryStore
from idem_middleware.jobs import _fingerprint, idempotent_job


@dataclass
class Transfer:
    amount: int
    _account: str


@dataclass
class Public:
    amount: int
    account: str


@dataclass(slots=True)
class Slotted:
    amount: int
    _account: str


class Kind(enum.Enum):
    HIDDEN = Transfer(1, "x")


@pytest.mark.parametrize(
    "argument",
    [
        Transfer(5, "acct-1"),
        [Transfer(5, "acct-1")],
        {"transfer": (1, Transfer(5, "acct-1"))},
        Slotted(5, "acct-1"),
        Kind.HIDDEN,
    ],
    ids=["dataclass", "in-a-list", "in-a-dict-and-tuple", "slotted", "an-enum-value"],
)
def test_an_argument_with_an_attribute_json_leaves_out_is_refused(argument: object) -> None:
    with pytest.raises(ConfigurationError, match=r"_account, an attribute JSON leaves out"):
        _fingerprint("send", (argument,), {})


async def test_a_call_with_one_is_refused_before_anything_runs_or_is_claimed() -> None:
    runs: list[str] = []
    store = MemoryStore()

    @idempotent_job(store, operation="send", key="k")
    async def send(ctx: IdempotencyContext, *, k: str, transfer: object) -> str:
        runs.append("ran")
        return "done"

    with pytest.raises(ConfigurationError):
        await send(k="k1", transfer=Transfer(5, "acct-1"))
    assert runs == []
    assert await send(k="k1", transfer=Public(5, "acct-1")) == "done"  # the key stayed free
    assert runs == ["ran"]


def test_public_attributes_do_count() -> None:
    assert _fingerprint("send", (Public(5, "a"),), {}) != _fingerprint(
        "send", (Public(6, "a"),), {}
    )
    assert _fingerprint("send", (Public(5, "a"),), {}) != _fingerprint(
        "send", (Public(5, "b"),), {}
    )

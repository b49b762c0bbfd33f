"""A dataclass's "_" attribute orjson leaves out is found inside another dataclass's public
attribute too (orjson writes the outer one's attributes, and leaves out the inner one's), and
named with its class; a dataclass's class among values (orjson writes no class) is no value
holding one."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from idem_middleware import ConfigurationError
from idem_middleware.jobs import _fingerprint
from idem_middleware.jsonvalues import changed_part


@dataclass
class Transfer:
    amount: int
    _account: str


@dataclass
class Order:
    transfer: Transfer


@dataclass(slots=True)
class SlottedOrder:
    transfers: list[Transfer]


@pytest.mark.parametrize(
    "argument",
    [Order(Transfer(5, "acct-1")), SlottedOrder([Transfer(5, "acct-1")])],
    ids=["in-a-dataclass", "in-a-slotted-dataclass's-list"],
)
def test_one_inside_a_dataclass_is_refused_named_with_its_class(argument: object) -> None:
    with pytest.raises(ConfigurationError, match=r"hold Transfer\._account, an attribute JSON"):
        _fingerprint("send", (argument,), {})
    assert changed_part([(argument,), {}]) == (
        "Transfer._account, an attribute JSON leaves out",
        "give it a public name, or pass a dict",
    )


def test_a_dataclass_class_is_no_value_holding_one() -> None:
    assert changed_part([Transfer, {"kind": Order}]) is None

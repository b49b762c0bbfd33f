"""What a job's tenant, key name and result may be: each found by probing, each refused loudly
where it was taken silently (on both stores)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from idem_middleware import IdempotencyContext, MemoryStore, Mode
from idem_middleware.errors import ConfigurationError
from idem_middleware.jobs import idempotent_job
from idem_middleware.store.base import Store


class Account:
    def __init__(self, number: int) -> None:
        self.number = number


async def test_a_tenant_function_returning_no_string_is_refused(store: Store) -> None:
    """It was made the tenant by `str()`: an object's repr, another tenant at every delivery of
    the same message, so the job ran again on each."""
    runs: list[str] = []

    @idempotent_job(store, operation="send", key="k", tenant=lambda **kw: kw["account"])
    async def send(ctx: IdempotencyContext, *, k: str, account: Any) -> int:
        runs.append(ctx.tenant)
        return len(runs)

    for bad in (Account(7), 7.0, True, b"acct-7"):
        with pytest.raises(ValueError, match="the job's tenant is a str, an int or a UUID"):
            await send(k="k1", account=bad)
    assert runs == []
    assert await send(k="k1", account=7) == 1  # an int is its digits
    assert await send(k="k1", account=7) == 1  # the stored result
    assert runs == ["7"]


async def test_a_tenant_function_may_name_an_account_by_uuid_or_enum(store: Store) -> None:
    """Found by probing: a tenant function answering an account's UUID was refused ("must be
    a str"), an IntEnum too, though an int was its digits; a str enum's member was kept as the
    member. Each is now its text, as a job's key is: one tenant for one account."""
    import enum
    import uuid

    class Region(str, enum.Enum):  # noqa: UP042 - its str() is `Region.EU`, not its value
        EU = "eu"

    class Number(enum.IntEnum):
        SEVEN = 7

    tenants: list[Any] = []

    @idempotent_job(store, operation="send", key="k", tenant=lambda **kw: kw["account"])
    async def send(ctx: IdempotencyContext, *, k: str, account: Any) -> int:
        tenants.append(ctx.tenant)
        return len(tenants)

    account = uuid.UUID(int=42)
    assert await send(k="k1", account=account) == 1
    assert await send(k="k1", account=account) == 1  # the same tenant: replayed
    assert await send(k="k1", account=Region.EU) == 2
    assert await send(k="k1", account=Number.SEVEN) == 3
    assert await send(k="k1", account=7) == 3  # the IntEnum's tenant is its digits
    assert await send(k="k1", account="eu") == 2  # the str enum's is its value
    assert tenants == [str(account), "eu", "7"]
    assert all(type(tenant) is str for tenant in tenants)


class MessageId:
    """An id object whose str() is object's own: its address, another at each delivery."""

    def __init__(self, value: str) -> None:
        self.value = value


async def test_a_key_argument_that_is_no_str_int_or_uuid_is_refused(store: Store) -> None:
    """Found by probing: the key was `str(value)` of anything: an object's str() held its
    address and a dict's its order, so each delivery of one message was another key, and the
    job ran again on each. A str, an int (its digits) and a UUID (its text) are kept."""
    import uuid

    runs: list[str] = []

    @idempotent_job(store, operation="send", key="k")
    async def send(ctx: IdempotencyContext, *, k: Any) -> int:
        runs.append(ctx.key)
        return len(runs)

    for value in (MessageId("m-1"), {"queue": "q", "id": 7}, 7.0, b"m-1", True):
        with pytest.raises(ValueError, match="is a str, an int or a UUID"):
            await send(k=value)
    assert runs == []
    message = uuid.UUID(int=7)
    assert [await send(k=v) for v in ("m-1", 7, message, "m-1", 7, message)] == [1, 2, 3, 1, 2, 3]
    assert runs == ["m-1", "7", str(message)]
    # An enum's member is its value's key (a str enum's str() may be `Kind.M1`).
    import enum

    class Kind(str, enum.Enum):  # noqa: UP042 - its str() is `Kind.M1`, not its value
        M1 = "m-1"

    class Number(enum.IntEnum):
        SEVEN = 7

    assert [await send(k=Kind.M1), await send(k=Number.SEVEN)] == [1, 2]
    assert len(runs) == 3


@pytest.mark.parametrize("signature", ["misspelt", "positional only"])
def test_a_key_name_no_keyword_can_pass_is_refused_when_decorated(signature: str) -> None:
    """Accepted, every call then failed with "pass the idempotency key argument 'invoice' by
    keyword", the argument passed by keyword all along (under its own name)."""
    decorate = idempotent_job(MemoryStore(), operation="send", key="invoice")

    async def misspelt(ctx: IdempotencyContext, *, invoice_id: str) -> None: ...

    async def positional_only(ctx: IdempotencyContext, invoice: str, /) -> None: ...

    fn = misspelt if signature == "misspelt" else positional_only
    with pytest.raises(ConfigurationError, match="key='invoice' names no parameter"):
        decorate(fn)


async def test_a_key_name_taken_by_any_keyword_is_accepted() -> None:
    @idempotent_job(MemoryStore(), operation="send", key="invoice")
    async def send(ctx: IdempotencyContext, **fields: Any) -> str:
        return str(fields["invoice"])

    assert await send(invoice="i-1") == "i-1"


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
async def test_a_result_json_would_store_as_null_is_refused(
    store: Store, mode: Mode, value: float
) -> None:
    """It came back as None, first call and repeat alike: the result returned was not the
    function's."""

    @idempotent_job(store, operation="ratio", key="k", mode=mode)
    async def ratio(ctx: IdempotencyContext, *, k: str) -> dict[str, float]:
        return {"ratio": value}

    with pytest.raises(ConfigurationError, match="NaN or an infinity"):
        await ratio(k=f"r-{mode}")


async def test_a_key_too_long_is_told_in_bytes() -> None:
    @idempotent_job(MemoryStore(), operation="send", key="k")
    async def send(ctx: IdempotencyContext, *, k: str) -> int:
        return 1

    with pytest.raises(ValueError, match="not 256 bytes"):  # (it said "not 128 characters")
        await send(k="\u00e9" * 128)


async def test_a_key_function_answering_an_int_or_a_uuid_keys_as_a_key_argument_does(
    store: Store,
) -> None:
    """Found by probing: `key="id"` took an int (its digits) or a UUID (its text), but a key
    function answering the same value was refused ("not int"). Both ways now make one key of
    one value: the job by name replays what the job by function stored."""
    import enum
    import uuid

    class Kind(str, enum.Enum):  # noqa: UP042 - its str() is `Kind.M1`, not its value
        M1 = "m-1"

    runs: list[str] = []

    @idempotent_job(store, operation="send", key=lambda **kw: kw["id"])
    async def send(ctx: IdempotencyContext, *, id: Any) -> int:
        runs.append(ctx.key)
        return len(runs)

    @idempotent_job(store, operation="send", key="id")
    async def by_name(ctx: IdempotencyContext, *, id: Any) -> int:
        raise AssertionError("the same key and arguments as `send`'s: replayed, never run")

    ident = uuid.UUID(int=9)
    assert [await send(id=v) for v in (7, ident, Kind.M1)] == [1, 2, 3]
    assert runs == ["7", str(ident), "m-1"]
    assert [await by_name(id=v) for v in (7, ident, Kind.M1)] == [1, 2, 3]
    for bad in (MessageId("m-1"), 7.0, None, True):
        with pytest.raises(ValueError, match="the key function's answer is"):
            await send(id=bad)
    assert len(runs) == 3


async def test_an_argument_json_cannot_write_is_named_in_the_refusal() -> None:
    """The refusal named neither the argument nor its type (orjson's words were in the cause
    alone): an amount given as a Decimal, say."""
    runs: list[str] = []

    @idempotent_job(MemoryStore(), operation="payouts.send", key="payout_id")
    async def send(ctx: IdempotencyContext, note: str, *, payout_id: str, amount: Any) -> None:
        runs.append(payout_id)

    with pytest.raises(
        ConfigurationError, match=r"amount is not \(Type is not JSON serializable: decimal\.Decimal"
    ):
        await send("n", payout_id="p1", amount=Decimal("10.50"))
    with pytest.raises(ConfigurationError, match=r"argument 1 is not \(.*bytes"):
        await send(b"n", payout_id="p1", amount="10.50")
    assert runs == []

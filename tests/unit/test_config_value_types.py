"""Configuration values as real apps pass them (read from settings libraries and enums): each is
taken and behaves as the plain value would, or is refused when it is made, naming the option.
Found by probing: a set of `include_headers` fingerprinted in each process's own order (a
retry landing on another worker was refused as a mismatch); a str enum's member given as an
operation or a status path was written `Op.PAY` (a 202's Location the status route refused);
`declare("release")` was compared by identity and left a lease-mode key unknown; a settings
library's URL given as a DSN had its password quoted in the error; a pool never awaited passed
the startup and every guarded request was a 503."""

from __future__ import annotations

import enum
import subprocess
import sys
import time
from typing import Any

import asyncpg
import pytest
from starlette.applications import Starlette

from idem_middleware import IdempotencyMiddleware, MemoryStore, Mode, Policy
from idem_middleware.context import claimed_context
from idem_middleware.errors import ConfigurationError
from idem_middleware.outcomes import Outcome
from idem_middleware.store.postgres import PostgresStore


class Op(str, enum.Enum):  # noqa: UP042 - its str() is `Op.PAY`, not its value: the case
    PAY = "POST /payments"
    STATUS = "/idempotency/status"
    HEADER = "X-Api-Version"


def test_a_set_of_header_names_is_kept_sorted_and_each_as_its_text() -> None:
    headers = {"x-b", "X-A", Op.HEADER}
    assert Policy(include_headers=headers).include_headers == ("x-a", "x-api-version", "x-b")
    assert Policy(include_headers=["x-b", "x-a"]).include_headers == ("x-b", "x-a")  # (as given)


def _fingerprint_in_a_process_of_its_own(seed: str) -> str:
    code = (
        "from idem_middleware import Policy\n"
        "from idem_middleware.fingerprint import Fingerprinter\n"
        "p = Policy(include_headers={'x-a', 'x-b', 'x-c', 'x-d', 'x-e', 'x-f'})\n"
        "headers = [(f'x-{c}'.encode(), c.encode()) for c in 'abcdef']\n"
        "print(Fingerprinter('POST /pay', {}, p)(b'', headers, None, b'').hex())\n"
    )
    env = {"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_a_set_of_header_names_fingerprints_alike_in_every_process() -> None:
    assert len({_fingerprint_in_a_process_of_its_own(seed) for seed in ("1", "2", "3")}) == 1


def test_a_str_enum_member_is_taken_as_its_text() -> None:
    policy = Policy(operation=Op.PAY)
    assert type(policy.operation) is str
    assert policy.operation == "POST /payments"
    mw = IdempotencyMiddleware(lambda *a: None, store=MemoryStore(), status_path=Op.STATUS)
    assert f"{mw.status_path}" == "/idempotency/status"
    keyed = IdempotencyMiddleware(lambda *a: None, store=MemoryStore(), policies={Op.PAY: policy})
    assert list(keyed.policies) == ["POST /payments"]


def test_only_an_unordered_collection_is_sorted_and_without_regard_to_case() -> None:
    ordered = {"x-b": 1, "x-a": 2}.keys()  # (a dict's keys keep their order: kept as given)
    assert Policy(include_headers=ordered).include_headers == ("x-b", "x-a")
    assert Policy(include_headers={"X-b", "x-A", "x-C"}).include_headers == ("x-a", "x-b", "x-c")


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
def test_declare_takes_an_outcomes_value_and_refuses_anything_else(mode: Mode) -> None:
    context = claimed_context("t", "POST /x", "k", 1, mode, None, 1)
    context.declare("release")  # type: ignore[arg-type]
    assert context.declared is Outcome.RELEASE
    with pytest.raises(ConfigurationError, match="declare takes an Outcome"):
        context.declare("bogus")  # type: ignore[arg-type]
    if mode is Mode.TRANSACTIONAL:
        with pytest.raises(ConfigurationError, match="cannot end unknown"):
            context.declare("unknown")  # type: ignore[arg-type]


class Url:
    """A settings library's URL object: its repr holds the password."""

    def __repr__(self) -> str:
        return "Url('postgresql://app:hunter2@db.example/app')"


@pytest.mark.parametrize("option", ["dsn", "listen_dsn"])
def test_a_dsn_that_is_no_str_is_refused_by_its_type_never_its_text(option: str) -> None:
    options: dict[str, Any] = {"dsn": "postgresql://db.example/app", option: Url()}
    with pytest.raises(ConfigurationError, match=rf"{option}=...\) is a PostgreSQL URL") as e:
        PostgresStore(**options)
    assert "hunter2" not in str(e.value)
    assert "str(url)" in str(e.value)


@pytest.mark.parametrize("pool", ["postgresql://db.example/app", object()])
def test_what_is_no_pool_is_refused_when_the_store_is_made(pool: Any) -> None:
    with pytest.raises(ConfigurationError, match="is an asyncpg pool, not a"):
        PostgresStore(pool=pool)


async def test_a_pool_never_awaited_is_refused_when_the_store_opens() -> None:
    pool = asyncpg.create_pool("postgresql://nobody@127.0.0.1:1/none")  # (never awaited)
    store = PostgresStore(pool=pool)  # (awaited later, in a lifespan, is fine)
    with pytest.raises(ConfigurationError, match="never awaited"):
        await store.open()


def test_previous_secrets_given_as_an_iterator_are_all_kept() -> None:
    from idem_middleware.tokens import TokenIssuer

    old = [b"o" * 32, b"p" * 32]
    issuer = TokenIssuer(MemoryStore(), secret=b"s" * 32, previous_secrets=iter(old))
    assert issuer._previous == tuple(old)


def test_a_memory_store_clock_that_is_no_function_is_refused() -> None:
    import time

    with pytest.raises(TypeError, match=r"MemoryStore\(clock=...\) is a plain function"):
        MemoryStore(clock=time.time())  # type: ignore[arg-type]


async def _async_clock() -> float:  # pragma: no cover - never awaited
    return 0.0


@pytest.mark.parametrize(
    "clock",
    [_async_clock, time.time_ns, lambda: time.time() * 1000, lambda: float("nan"), lambda: True],
    ids=["async", "nanoseconds", "milliseconds", "nan", "a bool"],
)
def test_a_memory_store_clock_that_does_not_answer_seconds_is_refused(clock: Any) -> None:
    """Found by probing: an async clock (or `datetime.now`) failed every guarded request after
    its handler ran; `time.time_ns` made a day's retention last 86 µs, and a retry ran the
    handler again."""
    with pytest.raises(TypeError, match=r"MemoryStore\(clock=...\)"):
        MemoryStore(clock=clock)
    assert MemoryStore(clock=lambda: 0.0).clock() == 0.0  # (a test's clock from zero is fine)


async def test_resolve_takes_a_resolutions_value_and_refuses_anything_else() -> None:
    from idem_middleware.errors import ResolveError
    from idem_middleware.ops import resolve
    from idem_middleware.store.base import RecordKey

    store = MemoryStore()
    with pytest.raises(ValueError, match="to is a Resolution"):
        await resolve(store, RecordKey("t", "POST /x", "k"), "bogus", note="n")  # type: ignore[arg-type]
    with pytest.raises(ResolveError, match="no record holds"):  # ("retry" taken as RETRY)
        await resolve(store, RecordKey("t", "POST /x", "k"), "retry", note="n")  # type: ignore[arg-type]


def test_claim_sessions_refuse_a_sync_engine_or_session_class() -> None:
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from idem_middleware.sqla import ClaimSessions

    with pytest.raises(ConfigurationError, match="is an AsyncEngine"):
        ClaimSessions(engine=create_engine("sqlite://"))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="is an AsyncSession class"):
        ClaimSessions(session_class=Session)  # type: ignore[arg-type]


def test_webhook_sender_refuses_a_url_that_is_no_str() -> None:
    import httpx

    from idem_middleware.outbox import webhook_sender

    client = httpx.AsyncClient()
    with pytest.raises(TypeError, match=r"url is a str \(str\(url\)\), not a Url"):
        webhook_sender(client, Url())
    assert webhook_sender(client, httpx.URL("https://receiver.example/e"))


@pytest.mark.parametrize("given", [["timeout", 5], "timeout=5"])
def test_connect_kwargs_that_are_no_mapping_are_refused(given: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"connect_kwargs=...\) is a dict"):
        PostgresStore(dsn="postgresql://db.example/app", connect_kwargs=given)


async def test_a_given_pool_never_awaited_fails_the_startup_check_too() -> None:
    """The store the app's own pool makes counts as open without `open()`: the middleware's
    startup checks it (`check_given_pool`), which logged the uninitialised pool and went on."""
    store = PostgresStore(pool=asyncpg.create_pool("postgresql://nobody@127.0.0.1:1/none"))
    with pytest.raises(ConfigurationError, match="never awaited"):
        await store.check_given_pool()


class SyncPoster:
    """A sync client that is no httpx.Client (a requests-like session): its post answers."""

    def __init__(self) -> None:
        self.posted = 0

    def post(self, url: Any, **options: Any) -> Any:
        self.posted += 1
        return type("Answer", (), {"status_code": 200})()


class WrappedAsync:
    """A wrapper whose post is a plain method returning the async client's coroutine."""

    def __init__(self) -> None:
        self.posted = 0

    def post(self, url: Any, **options: Any) -> Any:
        self.posted += 1

        async def answer() -> Any:
            return type("Answer", (), {"status_code": 201})()

        return answer()


@pytest.mark.parametrize("client_class", [SyncPoster, WrappedAsync])
async def test_webhook_sender_takes_a_post_that_answers_or_one_that_is_awaited(
    client_class: type,
) -> None:
    from idem_middleware.outbox import OutboxEvent, webhook_sender

    client = client_class()
    send = webhook_sender(client, "https://receiver.example/e")
    assert await send(OutboxEvent("e1", None, "credit", {}, 0)) is True
    assert client.posted == 1  # (awaited, a sync answer failed after its delivery: sent again)


@pytest.mark.parametrize(
    ("given", "error", "words"),
    [
        ((), TypeError, "takes the stores to open"),
        (([MemoryStore()],), TypeError, "not a list"),
        (("postgresql://localhost/db",), TypeError, "not a str"),
        ((Starlette(),), TypeError, "not a Starlette"),  # `lifespan=store_lifespan`, not called
        ((MemoryStore,), TypeError, "not a type"),  # the class, not a store
    ],
)
def test_store_lifespan_refuses_what_is_no_store_when_called(
    given: tuple[Any, ...], error: type[Exception], words: str
) -> None:
    from idem_middleware.store import store_lifespan

    with pytest.raises(error, match=words):
        store_lifespan(*given)


def test_store_lifespan_refuses_one_store_twice_and_takes_each_kind_of_store() -> None:
    from idem_middleware.store import store_lifespan

    memory = MemoryStore()
    with pytest.raises(ValueError, match="given one store twice"):
        store_lifespan(memory, memory)
    assert callable(store_lifespan(memory, PostgresStore(dsn="postgresql://127.0.0.1/db")))


@pytest.mark.parametrize("given", [True, False, "5", 0, -1.0, float("nan"), float("inf"), 1e10])
async def test_migrate_refuses_a_lock_timeout_that_is_no_number_of_seconds_before_any_work(
    given: Any,
) -> None:
    from idem_middleware.store.migrations import migrate

    # (Refused before the connection is used at all: an object() has none of its methods.)
    with pytest.raises(ValueError, match="lock_timeout must be more than 0"):
        await migrate(object(), lock_timeout=given)  # type: ignore[arg-type]

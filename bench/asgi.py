"""Direct-ASGI microbenchmark: µs per request of the app called in a loop, in-process.

`python -m bench.asgi [--rounds 9] [--requests 4000] [--dsn URL | --no-postgres] [--quick]`

No server and no socket: one coroutine awaits the ASGI app for one request after another (uvloop
when installed). Every variant serves the same FastAPI route, `POST /accounts/{id}/credits` with
a pydantic body model and a JSON response, behind the bench apps' bearer-token authentication
middleware; every request sends `{"amount": 5}` with a fresh Idempotency-Key; the handler writes
nothing, so the differences between variants are the middleware's and its store's own:

- `bare`: FastAPI and the authentication middleware only;
- `ours-memory`: IdempotencyMiddleware with a MemoryStore (transactional mode);
- `ours-tx`, `ours-lease`: transactional and lease mode on PostgreSQL (an embedded server unless
  `--dsn` names one; `--no-postgres` skips them).

Then bare, `ours-memory` and `floor-memory` (bench/floor.py: the least a pure-Python idempotency
middleware can do) timed request by request, taking turns (bench/paired.py), and the middleware's
own cost per stage for `ours-memory` (see bench/stages.py for how).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.types import Receive, Scope, Send

from idem_middleware import IdempotencyMiddleware, MemoryStore, Mode, PostgresStore, idempotent

from . import stages as st
from .app import TOKEN, BearerTenant, CreditIn, CreditOut, tenant_of
from .floor import FloorMiddleware
from .paired import measure_paired, paired_markdown

#: Stage -> the functions and methods whose self time is that stage, as (module, attribute): a
#: module-level function as the module that calls it names it, a method as "Class.method". A
#: target that is gone is skipped with a note; a stage none of whose targets ran shows 0 calls.
STAGES: dict[str, tuple[tuple[str, str], ...]] = {
    "key parse": (
        # (the headers by name, which the key, the host and the body's headers are read from)
        ("idem_middleware.middleware", "header_map"),
        ("idem_middleware.exchange", "parse_idempotency_key"),
        ("idem_middleware.exchange", "parse_key_value"),
    ),
    "tenant": (("idem_middleware.middleware", "Tenants.resolve"),),
    "route match": (
        ("idem_middleware.middleware", "IdempotencyMiddleware._router_below"),
        ("idem_middleware.middleware", "match_route"),
        ("idem_middleware.middleware", "IdempotencyMiddleware.policy_for"),
        ("idem_middleware.middleware", "route_guard"),
        ("idem_middleware.middleware", "unresolved_guard"),
    ),
    "body read": (
        ("idem_middleware.exchange", "Exchange.body_headers"),
        ("idem_middleware.exchange", "Exchange.read_body"),
        ("idem_middleware.exchange", "Exchange.read_rest"),
        ("idem_middleware.exchange", "Exchange.__call__"),
    ),
    "fingerprint": (("idem_middleware.fingerprint", "Fingerprinter.__call__"),),
    "claim": (
        ("idem_middleware.store.memory", "MemoryStore.transaction"),
        ("idem_middleware.store.memory", "_MemoryTransaction.claim"),
    ),
    # (its ContextVar's set and reset are inline in Attempt.run: "rest of the middleware")
    "context": (("idem_middleware.transactional", "claimed_context"),),
    "disconnect watch": (
        ("idem_middleware.delayed", "Delayed.add"),
        ("idem_middleware.delayed", "Delayed.discard"),
    ),
    "handler": (("bench.stages", "Downstream.__call__"),),
    "capture": (
        ("idem_middleware.capture", "ResponseCapture.__init__"),
        ("idem_middleware.capture", "ResponseCapture.__call__"),
    ),
    "settle": (
        ("idem_middleware.transactional", "Attempt._settle"),
        ("idem_middleware.capture", "ResponseCapture.stored"),
        ("idem_middleware.store.memory", "_MemoryTransaction.finish"),
    ),
    # (the held messages; their sends are the exchange's own: "rest of the middleware")
    "send": (
        ("idem_middleware.capture", "ResponseCapture.held"),
        ("idem_middleware.capture", "ResponseCapture.flush"),
    ),
    "answer": (("idem_middleware.exchange", "Exchange.answer"),),
    "rest of the middleware": (
        ("idem_middleware.middleware", "IdempotencyMiddleware.__call__"),
        ("idem_middleware.exchange", "Exchange.run"),
        ("idem_middleware.exchange", "run_transactional"),
        ("idem_middleware.transactional", "Attempt.run"),
    ),
}
#: The stage that is the app's own work (the same in bare), not the middleware's.
HANDLER = "handler"

VARIANTS = ("bare", "ours-memory", "ours-tx", "ours-lease")
#: Timed request by request only (with bare and ours-memory): the least a pure-Python
#: idempotency middleware can do (bench/floor.py), what the clock says any such middleware adds.
FLOOR = "floor-memory"
POSTGRES = ("ours-tx", "ours-lease")
#: Timed request by request only: bare and ours-memory, each request to a path of its own.
NEW_PATHS = ("bare, new paths", "ours-memory, new paths")
BODY = b'{"amount": 5}'
PATH = "/accounts/acc-1/credits"
_HEADERS = [
    (b"host", b"127.0.0.1"),
    (b"authorization", f"Bearer {TOKEN}".encode()),
    (b"content-type", b"application/json"),
    (b"content-length", str(len(BODY)).encode()),
]


async def tenant_now(request: Request) -> str:
    """bench.app's `tenant_of` as a coroutine: FastAPI runs a plain `def` dependency in its
    thread pool, a thread hand-off per request that would swamp what is measured here."""
    return tenant_of(request)


Tenant = Annotated[str, Depends(tenant_now)]


def build_app(variant: str, store: Any = None, *, downstream: bool = False) -> FastAPI:
    app = FastAPI()

    async def credit(
        account_id: str, body: CreditIn, tenant: Tenant, request: Request
    ) -> CreditOut:
        key = request.headers.get("idempotency-key")
        return CreditOut(
            credit_id=1, account_id=account_id, amount=body.amount, balance=body.amount, key=key
        )

    endpoint = idempotent(mode=Mode.LEASE)(credit) if variant == "ours-lease" else credit
    app.post("/accounts/{account_id}/credits", status_code=201)(endpoint)
    if downstream:
        app.add_middleware(st.Downstream)
    if variant == FLOOR:
        app.add_middleware(FloorMiddleware)
    elif store is not None:
        app.add_middleware(IdempotencyMiddleware, store=store)
    app.add_middleware(AuthenticationMiddleware, backend=BearerTenant())
    return app


def make_requests(prefix: str, n: int, new_paths: bool = False) -> list[tuple[Scope, Receive]]:
    """n requests, each with its own scope (the framework writes into it) and receive; with
    `new_paths`, each to an account of its own (an API whose paths hold ids: the middleware's
    route cache never has the path)."""
    out = []
    for i in range(n):
        path = f"/accounts/acc-{prefix}-{i}/credits" if new_paths else PATH
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "server": ("127.0.0.1", 8000),
            "client": ("127.0.0.1", 50000),
            "headers": [*_HEADERS, (b"idempotency-key", f"{prefix}-{i}".encode())],
        }
        out.append((scope, receive_once()))
    return out


def receive_once(body: bytes = BODY) -> Receive:
    """A client's receive: `body` in one message, then nothing (the client never leaves)."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client never leaves
        raise AssertionError("unreachable")

    return receive


@dataclass
class Variant:
    name: str
    app: Any
    requests: int
    batch: int
    statuses: Counter[int] = field(default_factory=Counter)
    wall: list[float] = field(default_factory=list)  # µs per request, one per round
    cpu: list[float] = field(default_factory=list)

    def send(self) -> Send:
        statuses = self.statuses

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                statuses[message["status"]] += 1

        return send  # type: ignore[return-value]


async def run_round(v: Variant, prefix: str) -> None:
    """`v.requests` requests in batches; the round's figure is the median batch's µs/request."""
    app, send = v.app, v.send()
    gc.collect()
    gc.freeze()
    walls, cpus = [], []
    for b in range(max(1, v.requests // v.batch)):
        todo = make_requests(f"{prefix}-{b}", v.batch)
        t0, c0 = time.perf_counter_ns(), time.process_time_ns()
        for scope, receive in todo:
            await app(scope, receive, send)
        t1, c1 = time.perf_counter_ns(), time.process_time_ns()
        walls.append((t1 - t0) / v.batch / 1000)
        cpus.append((c1 - c0) / v.batch / 1000)
    v.wall.append(statistics.median(walls))
    v.cpu.append(statistics.median(cpus))


async def measure(variants: list[Variant], rounds: int, warmup: int) -> None:
    for v in variants:
        for _ in range(max(1, warmup // v.batch)):
            await run_round(Variant(v.name, v.app, v.batch, v.batch, v.statuses), "warm")
    for r in range(rounds):
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:  # interleaved: load drifts hit every variant
            await run_round(v, f"r{r}")
            log(f"round {r + 1} {v.name:12} {v.wall[-1]:8.1f} µs wall {v.cpu[-1]:8.1f} µs CPU")


@dataclass
class StageResult:
    per_round: dict[str, list[float]]  # stage -> µs per request, one per round
    calls: dict[str, float]  # stage -> calls per request (the last round)
    wrapped_total: list[float]  # µs per request of the wrapped run, less the wrappers' cost
    notes: list[str]
    #: Per round: the wrapper's own cost, ns per call, inside/outside its interval, by kind.
    cals: list[dict[str, list[float]]]


async def measure_stages(rounds: int, requests: int, batch: int, warmup: int) -> StageResult:
    rec = st.Recorder(list(STAGES))
    calls_per_calibration = 10_000 if requests >= 1000 else 1_000
    await st.calibrate(rec, calls=calls_per_calibration)
    app = build_app("ours-memory", MemoryStore(), downstream=True)
    installed, notes = st.install(rec, STAGES)
    per_round: dict[str, list[float]] = {s: [] for s in STAGES}
    totals: list[float] = []
    calls: dict[str, float] = {}
    cals: list[dict[str, list[float]]] = []
    try:
        v = Variant("stages", app, requests, batch)
        await measure([Variant("stages", app, batch, batch)], 0, warmup)
        for r in range(rounds):
            await st.calibrate(rec, calls=calls_per_calibration)
            cals.append({k: list(c) for k, c in rec.cal.items()})
            rec.reset()
            await run_round(v, f"s{r}")
            n = max(1, requests // batch) * batch
            if rec.interleaved:
                notes.append(f"round {r + 1}: wrapped calls interleaved; the stages are unsure")
            for s in STAGES:
                per_round[s].append(rec.self_ns(s) / n / 1000)
            calls = {s: rec.calls(s) / n for s in STAGES}
            totals.append(v.wall[-1] - rec.overhead_ns() / n / 1000)
            log(
                f"stages round {r + 1}: {v.wall[-1]:.1f} µs/request wrapped, "
                f"{totals[-1]:.1f} less the wrappers; wrapper ns {cals[-1]}"
            )
        if set(v.statuses) != {201}:
            notes.append(f"statuses in the stage run: {dict(v.statuses)}")
    finally:
        st.uninstall(installed)
    return StageResult(per_round, calls, totals, notes, cals)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):,.1f} ({min(values):,.1f}-{max(values):,.1f})"


def markdown(
    variants: list[Variant],
    stages: StageResult | None,
    info: dict[str, str],
    pg_note: str,
    paired: str = "",
) -> str:
    lines = [f"- {k}: {v}" for k, v in info.items()]
    lines += [
        "",
        "| variant | µs per request, wall: median of rounds (min-max) | CPU µs per request | "
        "+ µs vs bare | statuses |",
        "|---|---|---|---|---|",
    ]
    bare = next((v for v in variants if v.name == "bare"), None)
    for v in variants:
        delta = "—"
        if bare is not None and v is not bare:
            delta = f"{statistics.median(v.wall) - statistics.median(bare.wall):+,.1f}"
        lines.append(
            f"| {v.name} | {_spread(v.wall)} | {statistics.median(v.cpu):,.1f} | {delta} "
            f"| {dict(v.statuses)} |"
        )
    if pg_note:
        lines += ["", pg_note]
    if paired:
        lines += ["", paired]
    if stages is None:
        return "\n".join(lines)
    lines += [
        "",
        "Stages of ours-memory (self time; the wrappers' own cost subtracted):",
        "",
        "| stage | µs per request: median of rounds (min-max) | calls per request | timed |",
        "|---|---|---|---|",
    ]
    for s, targets in STAGES.items():
        where = ", ".join(t[1] for t in targets)
        lines.append(
            f"| {s} | {_spread(stages.per_round[s])} | {stages.calls.get(s, 0):.2f} | {where} |"
        )
    rounds = len(stages.wrapped_total)
    own = [sum(stages.per_round[s][r] for s in STAGES if s != HANDLER) for r in range(rounds)]
    lines.append(f"| **the middleware (every stage but handler)** | {_spread(own)} | | |")
    lines.append(
        f"| the wrapped run, less the wrappers' cost | {_spread(stages.wrapped_total)} | | |"
    )
    memory = next((v for v in variants if v.name == "ours-memory"), None)
    if memory is not None and bare is not None:
        diff = statistics.median(memory.wall) - statistics.median(bare.wall)
        lines.append(
            f"\nCross-checks: ours-memory unwrapped {statistics.median(memory.wall):,.1f} µs; "
            f"ours-memory - bare {diff:,.1f} µs (the middleware's stages should come near it)."
        )
    cal = {
        k: "/".join(
            f"{min(c[k][i] for c in stages.cals):.0f}-{max(c[k][i] for c in stages.cals):.0f}"
            for i in (0, 1)
        )
        for k in ("sync", "async")
    }
    lines.append(
        "Wrapper cost subtracted per call, measured before each round (ns, inside/outside the "
        f"interval, min-max over rounds): sync {cal['sync']}, async {cal['async']}."
    )
    lines += [f"- note: {n}" for n in stages.notes]
    return "\n".join(lines)


def _info(args: argparse.Namespace, loop_name: str, load: tuple[float, ...]) -> dict[str, str]:
    from importlib.metadata import version

    return {
        "command": "python -m bench.asgi " + " ".join(args.argv),
        "python": sys.version.split()[0],
        "fastapi / starlette / pydantic": " / ".join(
            version(p) for p in ("fastapi", "starlette", "pydantic")
        ),
        "event loop": loop_name,
        "cores": str(os.cpu_count()),
        "rounds x requests (batch)": f"{args.rounds} x {args.requests} ({args.batch}); "
        f"PostgreSQL variants {args.requests // 5} ({max(1, args.batch // 5)}); "
        f"warm-up {args.warmup}",
        "load average at start / end": f"{load[0]:.2f} / {os.getloadavg()[0]:.2f}",
    }


async def main_async(args: argparse.Namespace, loop_name: str) -> str:
    load = os.getloadavg()
    variants = [
        Variant("bare", build_app("bare"), args.requests, args.batch),
        Variant("ours-memory", build_app("ours-memory", MemoryStore()), args.requests, args.batch),
    ]
    pg_note = ""
    async with _postgres(args) as dsn:
        stores = []
        if dsn is None:
            pg_note = "PostgreSQL variants skipped (--no-postgres)."
        else:
            for name in POSTGRES:
                store = PostgresStore(dsn=dsn, min_size=2, max_size=2)
                await store.open()
                stores.append(store)
                n, batch = args.requests // 5, max(1, args.batch // 5)
                variants.append(Variant(name, build_app(name, store), n, batch))
            pg_note = "PostgreSQL: " + args.pg_where
        try:
            await measure(variants, args.rounds, args.warmup)
            # The loop again, request by request (see bench/paired.py), for the MemoryStore
            # middleware and the floor against bare: what each adds, the machine's drift
            # cancelled.
            counted = Variant("paired", None, 0, 1)
            floor = build_app(FLOOR)
            send = counted.send()
            for scope, receive in make_requests("floor-warm", args.warmup):
                await floor(scope, receive, send)
            counted.statuses.clear()
            bare, memory = (v.app for v in variants[:2])
            apps = {"bare": bare, "ours-memory": memory, FLOOR: floor}
            apps |= {NEW_PATHS[0]: bare, NEW_PATHS[1]: memory}
            makers = dict.fromkeys(apps, make_requests)
            makers |= dict.fromkeys(NEW_PATHS, functools.partial(make_requests, new_paths=True))
            paired = await measure_paired(apps, args.rounds * args.requests, send, makers)
        finally:
            for store in stores:
                await store.close()
    stages = await measure_stages(args.rounds, args.requests, args.batch, args.warmup)
    gc.unfreeze()
    by_request = (
        paired_markdown(paired, names=["bare", "ours-memory", FLOOR])
        + "\n\nThe same, each request to a path of its own (an id in the path, as most APIs"
        " have: the middleware's route cache never has it, and the route is found again):\n\n"
        + paired_markdown(paired, NEW_PATHS[0], list(NEW_PATHS))
        + f"\n\nStatuses, request by request: {dict(counted.statuses)}"
    )
    return markdown(variants, stages, _info(args, loop_name, load), pg_note, by_request)


class _postgres:
    """The DSN of a database with the library's migrations: on --dsn's server, or an embedded
    one; None with --no-postgres."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.pg: Any = None

    async def __aenter__(self) -> str | None:
        from .db import EmbeddedPostgres, prepare_database

        if self.args.no_postgres:
            return None
        admin = self.args.dsn
        if admin is None:
            self.pg = EmbeddedPostgres().__enter__()
            admin = self.pg.dsn
            self.args.pg_where = "an embedded server (Unix socket), database bench_asgi"
        else:
            self.args.pg_where = "--dsn's server, database bench_asgi"
        return await prepare_database(admin, "bench_asgi")

    async def __aexit__(self, *exc: object) -> None:
        if self.pg is not None:
            self.pg.__exit__(None, None, None)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.asgi", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=9, help="measured rounds per variant")
    p.add_argument("--requests", type=int, default=4000, help="requests per round")
    p.add_argument("--batch", type=int, default=100, help="requests per timed batch")
    p.add_argument("--warmup", type=int, default=500, help="unmeasured requests per variant")
    p.add_argument("--dsn", help="an admin URL of a PostgreSQL server (default: embedded)")
    p.add_argument("--no-postgres", action="store_true", help="skip ours-tx and ours-lease")
    p.add_argument("--quick", action="store_true", help="a few requests only (a smoke test)")
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if args.quick:
        args.rounds, args.requests, args.batch, args.warmup = 2, 50, 10, 20
    if args.rounds < 1 or args.requests < args.batch or args.batch < 1:
        p.error("--rounds and --batch must be at least 1, and --requests at least --batch")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import uvloop

        runner: Any = uvloop.run
        loop_name = f"uvloop {uvloop.__version__}"
    except ImportError:  # pragma: no cover - the bench extra installs it
        runner, loop_name = asyncio.run, "asyncio"
    print(runner(main_async(args, loop_name)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What a large app's routes cost the middleware when its route cache does not have the path.

`python -m bench.routes [--routes 0,20,100] [--requests 2000]`: the direct-ASGI loop of
`bench.asgi`, request by request (`bench/paired.py`), every request to a path of its own
(`/accounts/<new id>/credits`, as an API with ids in its paths), for apps with `--routes` other
POST routes before the measured one: laid out flat in the app, in one included `APIRouter`, in
five included routers (FastAPI's `include_router`), and in five included each under a prefix of
its own (`/section<n>`, the measured route's under `/accounts`), as apps lay out one per
resource. Each app is timed bare and behind the middleware with a `MemoryStore`, the two taking
turns; the table gives what the middleware adds. The bare app's own router walks the routes
too: its µs grow with them.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from typing import Any

from fastapi import APIRouter, FastAPI
from starlette.middleware.authentication import AuthenticationMiddleware

from idem_middleware import IdempotencyMiddleware, MemoryStore

from .app import BearerTenant, CreditIn, CreditOut
from .asgi import Tenant, make_requests
from .paired import loop_runner, measure_paired

LAYOUTS = ("flat", "one router", "five routers", "five routers, each with a prefix")


def build_app(layout: str, others: int, guarded: bool) -> FastAPI:
    """`others` POST routes (`/things<n>/{thing_id}/do`), then the measured one, in `layout`."""
    app = FastAPI()
    prefixed = layout == "five routers, each with a prefix"
    routers = [APIRouter() for _ in range(5 if layout.startswith("five") else 1)]

    async def other(thing_id: str) -> dict[str, str]:
        return {}

    async def credit(account_id: str, body: CreditIn, tenant: Tenant) -> CreditOut:
        amount = body.amount
        return CreditOut(
            credit_id=1, account_id=account_id, amount=amount, balance=amount, key=None
        )

    for n in range(others):
        target = app if layout == "flat" else routers[n * len(routers) // max(others, 1)]
        target.post(f"/things{n}/{{thing_id}}/do", status_code=201)(other)
    if layout == "flat":
        app.post("/accounts/{account_id}/credits", status_code=201)(credit)
    elif prefixed:  # (as apps lay them out: a router per resource, included under its prefix)
        routers[-1].post("/{account_id}/credits", status_code=201)(credit)
        for n, router in enumerate(routers):
            app.include_router(router, prefix="/accounts" if n == 4 else f"/section{n}")
    else:
        routers[-1].post("/accounts/{account_id}/credits", status_code=201)(credit)
        for router in routers:
            app.include_router(router)
    if guarded:
        app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    app.add_middleware(AuthenticationMiddleware, backend=BearerTenant())
    return app


async def measure(counts: list[int], requests: int, warmup: int) -> list[dict[str, Any]]:
    rows = []
    statuses: dict[int, int] = {}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses[message["status"]] = statuses.get(message["status"], 0) + 1

    new_paths = functools.partial(make_requests, new_paths=True)
    for layout in LAYOUTS:
        for others in counts:
            apps = {"bare": build_app(layout, others, False)}
            apps["ours-memory"] = build_app(layout, others, True)
            for name, app in apps.items():
                for scope, receive in new_paths(f"w{name}", warmup):
                    await app(scope, receive, send)
            times = await measure_paired(apps, requests, send, new_paths)  # type: ignore[arg-type]
            bare, ours = (statistics.median(times[name]) for name in apps)
            rows.append({"layout": layout, "others": others, "bare": bare, "ours": ours})
    if set(statuses) != {201}:
        raise SystemExit(f"not every request was answered 201: {statuses}")
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| other POST routes, laid out | bare µs | + the middleware, µs (median) | x bare |",
        "|---|---|---|---|",
    ]
    for row in rows:
        added = row["ours"] - row["bare"]
        lines.append(
            f"| {row['others']}, {row['layout']} | {row['bare']:,.1f} | {added:+,.1f} "
            f"| {added / row['bare']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.routes", description=__doc__.split("\n")[0])
    p.add_argument("--routes", default="0,20,100", help="other POST routes, comma-separated")
    p.add_argument("--requests", type=int, default=2000, help="requests per app")
    p.add_argument("--warmup", type=int, default=300, help="unmeasured requests per app")
    args = p.parse_args(argv)
    counts = [int(n) for n in args.routes.split(",")]
    runner = loop_runner()
    print(markdown(runner(measure(counts, args.requests, args.warmup))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

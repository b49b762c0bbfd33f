"""A guided tour of the example app: `python -m example_app.tour [--url URL [--bank-url URL]]`.

Without `--url` the tour starts everything itself, on free loopback ports under a temporary
working directory: the bank simulator as its own process (so it outlives an app crash, as a real
bank would), and the app with its embedded PostgreSQL, a 2 s lease and a 1 s bounded wait, and
without its outbox publisher (EXAMPLE_PUBLISH=0): the last step runs `idem-middleware outbox
publish` itself, and kills it. It stops all of it (by PID) when it ends, fails or is interrupted.

With `--url` it talks to an app you are running; `--bank-url` defaults to the in-process bank
mounted under `/bank`. The crash and publisher steps need to own the processes (and the
database), so they are skipped then.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from typing import Any, NoReturn

import asyncpg
import httpx

from .launcher import ServerFailed, ServerProcess
from .tour_print import compact, show_request, show_response, step
from .tour_stack import (
    BANK_TIMEOUT,
    LEASE_SECONDS,
    TourError,
    check_given,
    embedded_database_url,
    local_stack,
)

TENANT_A = {"authorization": "Bearer demo-a"}
STARTING_BALANCE = 100
#: How long the bank holds its answer to a webhook in step (f): far longer than the step takes.
WEBHOOK_DELAY_MS = 30_000


def fail(message: str) -> NoReturn:
    raise TourError(message)


# --- the tour -------------------------------------------------------------------------------


class Tour:
    def __init__(self, app: httpx.AsyncClient, bank: httpx.AsyncClient) -> None:
        self.app = app
        self.bank = bank
        # Fresh keys and accounts on every run, so the tour also works against a long-lived app.
        self.run = uuid.uuid4().hex[:6]
        self.payouts: list[tuple[str, str, int]] = []  # (step, account, amount)
        self.outbox: tuple[int, int, list[str]] | None = None  # (events, deliveries, applied)

    def key(self, name: str) -> str:
        return f'"tour-{self.run}-{name}"'

    async def post(
        self, path: str, body: Any, key: str | None, *, quiet: bool = False
    ) -> httpx.Response:
        headers = {**TENANT_A, **({"idempotency-key": key} if key else {})}
        if not quiet:
            show_request("POST", path, key, body)
        r = await self.app.post(path, json=body, headers=headers)
        if not quiet:
            show_response(r)
        return r

    async def account(self, account_id: str) -> dict[str, Any]:
        r = await self.app.get(f"/accounts/{account_id}", headers=TENANT_A)
        if r.status_code != 200:
            fail(f"GET /accounts/{account_id} answered {r.status_code}")
        body: dict[str, Any] = r.json()
        return body

    async def transfers_for(self, account_id: str) -> list[dict[str, Any]]:
        r = await self.bank.get("/transfers")
        # The app names the bank account "<tenant>:<account>".
        return [t for t in r.json() if t["account"] == f"tenant-a:{account_id}"]

    async def faults(self, **faults: int) -> None:
        print(f"  (bank faults: {faults or 'cleared'})")
        r = await self.bank.post("/_faults", json=faults)
        if r.status_code != 200:
            fail(f"the bank refused the faults {faults}: {r.status_code}")

    async def funded_account(self, name: str) -> str:
        account = f"acc-{self.run}-{name}"
        r = await self.post(
            f"/accounts/{account}/credits", {"amount": STARTING_BALANCE}, self.key(f"fund-{name}")
        )
        if r.status_code != 201:
            fail(f"funding {account} answered {r.status_code}")
        return account

    async def credit_and_replay(self) -> None:
        step(
            "(a) A credit, then the same request again",
            "A credit runs in transactional mode: the claim, the ledger write and the stored\n"
            "response commit in one transaction. Sending it again replays the stored answer.",
        )
        account, key, body = f"acc-{self.run}-a", self.key("credit"), {"amount": 25}
        first = await self.post(f"/accounts/{account}/credits", body, key)
        again = await self.post(f"/accounts/{account}/credits", body, key)
        if again.headers.get("idempotent-replayed") != "true" or again.json() != first.json():
            fail("the second request was not a replay of the first")
        print("  Same status, same body, and Idempotent-Replayed: true: the credit ran once.")

        step(
            "(b) The same key with another body",
            "The key names one intent; its request fingerprint is stored with it. Reusing the\n"
            "key for a different request is a client bug, refused with 422.",
        )
        reused = await self.post(f"/accounts/{account}/credits", {"amount": 26}, key)
        if reused.status_code != 422:
            fail(f"expected 422, got {reused.status_code}")

    async def burst(self) -> None:
        step(
            "(c) 20 concurrent duplicates",
            "A double-clicking client or an eager retry policy: 20 identical requests at once.\n"
            "One claims the key; the others wait on it and replay its response.",
        )
        account, key = f"acc-{self.run}-c", self.key("burst")
        show_request("POST", f"/accounts/{account}/credits", key, {"amount": 5})
        print("     ... x20, concurrently")
        responses = await asyncio.gather(
            *(
                self.post(f"/accounts/{account}/credits", {"amount": 5}, key, quiet=True)
                for _ in range(20)
            )
        )
        replayed = sum(r.headers.get("idempotent-replayed") == "true" for r in responses)
        tally = dict(sorted(Counter(r.status_code for r in responses).items()))
        print(f"  <- statuses {tally}; {replayed} of them with Idempotent-Replayed: true")
        state = await self.account(account)
        print(f"  GET /accounts/{account} -> {compact(state)}")
        if state["credits"] != 1:
            fail(f"expected one execution, the account has {state['credits']} credits")
        print(f"  credits = {state['credits']}: one execution for 20 requests.")

    async def lost_bank_answer(self) -> None:
        step(
            "(d) A payout whose bank response is lost",
            "Payouts run in lease mode: the money leaves through the bank, outside our database.\n"
            "The bank records the transfer, then its answer is lost (fail_after_record: 500).",
        )
        account = await self.funded_account("d")
        payout, key = {"account_id": account, "amount": 30}, self.key("payout-d")
        await self.faults(fail_after_record=500)
        lost = await self.post("/payouts", payout, key)
        if lost.status_code != 502:
            fail(f"expected 502, got {lost.status_code}")
        print(
            "  The app cannot know whether the money moved: the record is now `unknown`, and\n"
            "  the 30 stay held. A blind retry could pay twice; this one reconciles."
        )
        await self.faults()
        retry = await self.post("/payouts", payout, key)
        if retry.status_code != 201:
            fail(f"expected the reconciled 201, got {retry.status_code}")
        transfers = await self.transfers_for(account)
        print(
            "  reconciled: the retry asked the bank GET /transfers/{downstream key}, found the\n"
            "  transfer, recorded the debit and stored this 201, which every later retry replays.\n"
            f"  The bank holds {len(transfers)} transfer for {account}."
        )
        self.payouts.append(("(d) bank answer lost", account, 30))

    async def crash(self, app: ServerProcess, bank: ServerProcess) -> None:
        step(
            "(e) The app crashes in the middle of a payout",
            "The bank is slowed down (delay_ms) so the handler is waiting on it when the app is\n"
            "SIGKILLed: no exception handler, no rollback code, no goodbye.",
        )
        account = await self.funded_account("e")
        payout, key = {"account_id": account, "amount": 40}, self.key("payout-e")
        # Shorter than the app's bank timeout (2 s), so the handler is still waiting when we kill.
        await self.faults(delay_ms=int(BANK_TIMEOUT * 750))
        in_flight = asyncio.create_task(self.post("/payouts", payout, key))
        # The bank records the transfer before its delay: once it shows up, the handler is
        # inside the bank call. Poll for it (bounded) rather than guess with a sleep.
        deadline = time.monotonic() + 5
        while not await self.transfers_for(account):
            if time.monotonic() > deadline:
                fail("the payout never reached the bank")
            await asyncio.sleep(0.05)
        pid = app.proc.pid if app.proc else "?"
        app.kill()
        killed_at = time.monotonic()
        print(f"  ** the bank has the transfer: SIGKILL to the app's process group (pid {pid})")
        try:
            await in_flight
            fail("the request survived the crash")
        except httpx.TransportError as exc:
            print(f"  <- no response: {type(exc).__name__} (the client cannot know what happened)")
        await self.faults()
        await asyncio.to_thread(app.start)
        print(
            "  App restarted on the same database. The dead process's lease still runs; once\n"
            f"  it lapses ({LEASE_SECONDS:.0f} s) the record is `unknown` and a retry reconciles."
        )
        await asyncio.sleep(max(0.0, LEASE_SECONDS - (time.monotonic() - killed_at)) + 0.2)
        for _ in range(5):  # bounded: a 409 here means the lease had not lapsed yet
            retry = await self.post("/payouts", payout, key)
            if retry.status_code != 409:
                break
            await asyncio.sleep(min(float(retry.headers.get("retry-after", "1")), 2.0))
        if retry.status_code != 201:
            fail(f"expected the reconciled 201, got {retry.status_code}")
        print("  reconciled: the bank had the transfer, so the debit was recorded exactly once.")
        self.payouts.append(("(e) app crashed mid-payout", account, 40))

    async def killed_publisher(self, dsn: str, bank_url: str) -> None:
        step(
            "(f) A publisher killed between sending and marking",
            "Every credit and payout above also wrote an event to the outbox, in the same\n"
            "transaction as its business write. A publisher sends the events to the bank's\n"
            "POST /webhooks and marks them sent once the bank answered. The bank applies the\n"
            "first event, then holds its answer (webhook_delay_ms): the publisher is SIGKILLed.",
        )
        conn = await asyncpg.connect(dsn)
        try:
            await self._kill_and_republish(conn, dsn, f"{bank_url}/webhooks")
        finally:
            await conn.close()

    async def _kill_and_republish(self, conn: Any, dsn: str, url: str) -> None:
        async def unsent() -> int:
            count: int = await conn.fetchval(
                "SELECT count(*) FROM idem_outbox WHERE sent_at IS NULL"
            )
            return count

        publish = ["-m", "idem_middleware.cli", "outbox", "publish", "--url", url]
        env = {**os.environ, "IDEM_DATABASE_URL": dsn}
        await self.faults(webhook_delay_ms=WEBHOOK_DELAY_MS)
        print(f"  $ idem-middleware outbox publish --url {url}    (IDEM_DATABASE_URL: the app's)")
        publisher = await asyncio.create_subprocess_exec(
            sys.executable,
            *publish,
            "--idle-seconds",
            "0.2",
            # An event it was sending when killed is reserved for 2.5 s, then sent again.
            "--send-timeout",
            "2",
            "--reservation-margin",
            "0.5",
            env=env,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 15
            while not (hooks := (await self.bank.get("/webhooks")).json())["deliveries"]:
                if time.monotonic() > deadline or publisher.returncode is not None:
                    fail("the publisher never reached the bank")
                await asyncio.sleep(0.05)
            waiting = await unsent()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(publisher.pid, signal.SIGKILL)
            await asyncio.wait_for(publisher.wait(), 10)
        first = hooks["applied"][0].partition("-")[0]
        print(
            f"  ** the bank applied {first}…, and the outbox still has {waiting} unsent events:\n"
            f"     SIGKILL to the publisher (pid {publisher.pid})"
        )
        await self.faults()
        for _ in range(10):  # bounded: the dead publisher's reservation lapses after 2.5 s
            print(f"  $ idem-middleware outbox publish --url {url} --once")
            once = await asyncio.create_subprocess_exec(
                sys.executable,
                *publish,
                "--once",
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            try:
                out, err = await asyncio.wait_for(once.communicate(), 30)
            except TimeoutError:
                once.kill()
                await once.wait()
                fail("idem-middleware outbox publish --once did not finish in 30 s")
            lines = (out or err).decode().strip().splitlines()
            print(f"  <- {lines[-1] if lines else f'exit status {once.returncode}'}")
            if not await unsent():
                break
            await asyncio.sleep(0.2)
        else:
            fail("events are still unsent after 10 publisher runs")
        events: int = await conn.fetchval("SELECT count(*) FROM idem_outbox")
        hooks = (await self.bank.get("/webhooks")).json()
        self.outbox = (events, hooks["deliveries"], hooks["applied"])
        print(
            f"  events in the outbox    {events:>3}  (all sent)\n"
            f"  deliveries at the bank  {hooks['deliveries']:>3}  (the killed publisher's one,"
            " then every event)\n"
            f"  events applied          {len(hooks['applied']):>3}  (the bank knew the redelivered"
            " event id)"
        )

    async def summary(self) -> bool:
        step("Summary", "Per payout: transfers the bank holds, and debits in the account.")
        print(f"  {'payout':<28} {'bank transfers':>14} {'debits':>7}")
        ok = True
        for name, account, amount in self.payouts:
            transfers = len(await self.transfers_for(account))
            # One payout per account: whatever left the account left it in debits of `amount`.
            debits = (STARTING_BALANCE - (await self.account(account))["balance"]) // amount
            print(f"  {name:<28} {transfers:>14} {debits:>7}")
            ok = ok and transfers == debits == 1
        print(
            "  One transfer and one debit per payout: no money lost, none sent twice."
            if ok
            else "  MISMATCH: a payout did not move money exactly once."
        )
        if self.outbox is not None:
            events, deliveries, applied = self.outbox
            once = len(applied) == len(set(applied)) == events == deliveries - 1
            print(
                f"  Outbox: {events} events, {deliveries} deliveries, {len(applied)} applied: "
                + ("each event applied exactly once." if once else "MISMATCH.")
            )
            ok = ok and once
        return ok


async def tour(
    app_url: str, bank_url: str, servers: tuple[ServerProcess, ServerProcess] | None
) -> bool:
    async with (
        httpx.AsyncClient(base_url=app_url, timeout=15) as app,
        httpx.AsyncClient(base_url=bank_url, timeout=15) as bank,
    ):
        if servers is None:
            await check_given(app, bank, TENANT_A)
        t = Tour(app, bank)
        print(f"App {app_url}, bank {bank_url}; every request as tenant-a (Bearer demo-a).")
        await t.credit_and_replay()
        await t.burst()
        await t.lost_bank_answer()
        if servers is not None:
            await t.crash(*servers)
            await t.killed_publisher(embedded_database_url(servers[0].cwd), bank_url)
        else:
            step("(e) skipped", "The crash step kills and restarts the app: run without --url.")
            step("(f) skipped", "The publisher step needs the app's database: run without --url.")
        return await t.summary()


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # so the `finally` blocks stop what the tour started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m example_app.tour", description=__doc__)
    parser.add_argument("--url", help="a running example app (default: start one)")
    parser.add_argument("--bank-url", help="its bank (default: URL/bank, the in-process bank)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    started = time.monotonic()
    try:
        if args.url:
            url = args.url.rstrip("/")
            ok = asyncio.run(tour(url, args.bank_url or url + "/bank", None))
        else:
            with local_stack() as (app, bank):
                ok = asyncio.run(tour(app.url, bank.url, (app, bank)))
    except (TourError, ServerFailed, httpx.HTTPError) as exc:
        print(f"\nThe tour stopped: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print(f"\nDone in {time.monotonic() - started:.1f} s.")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""`python -m bench.fingerprint`: the fingerprint's cost per request, typical and worst case.

Prints one Markdown table: microseconds per fingerprint (best of 5 repeats of a timed loop of
a path's `Fingerprinter`, made once per case as the middleware makes one per path) for typical
requests, for the worst bodies the default caps still accept (1 MiB bodies at Policy's
max_fields and max_json_values), and for what the caps refuse (the time to the refusal).
Every call runs on the event loop's thread, so the worst accepted row is the longest a
request's fingerprint can hold the loop with the default policy."""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable
from typing import Any

from idem_middleware import Policy
from idem_middleware import fingerprint as fingerprint_module
from idem_middleware.errors import RequestRejected
from idem_middleware.fingerprint import Fingerprinter

from .bodies import BODIES

MIB = 1 << 20
#: What a Fingerprinter reads per request, in its call's order; the rest is the path's.
_PER_REQUEST = ("query_string", "headers", "content_type", "body")
POLICY = Policy()
FIELDS = POLICY.max_fields
VALUES = POLICY.max_json_values
JSON = b"application/json"
FORM = b"application/x-www-form-urlencoded"


def request(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "operation": "POST /accounts/{account_id}/credits",
        "path_params": {"account_id": "acc1"},
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "include_headers": (),
        "content_type": JSON,
        "body": b'{"amount": 5, "memo": "x"}',
        "max_fields": FIELDS,
        "max_json_values": VALUES,
    }
    base.update(overrides)
    return base


def pad_json_string(prefix: bytes, suffix: bytes) -> bytes:
    """prefix + a string member filling the body to 1 MiB + suffix."""
    room = MIB - len(prefix) - len(suffix) - len(b',"pad":""')
    return prefix + b',"pad":"' + b"x" * room + b'"' + suffix


def multipart(parts: int, size: int) -> bytes:
    part = b'--Bq7\r\nContent-Disposition: form-data; name="f"\r\n\r\n' + b"v" * size + b"\r\n"
    return part * parts + b"--Bq7--\r\n"


def cases() -> list[tuple[str, str, dict[str, Any]]]:
    payment = (
        b'{"amount": 1250, "currency": "EUR", "memo": "invoice 2024-117",'
        b' "to": {"iban": "DE89370400440532013000", "name": "A. Person"},'
        b' "lines": [{"sku": "a-1", "qty": 2, "price": 4.5},'
        b' {"sku": "b-2", "qty": 1, "price": 3.25}]}'
    )
    lines = b",".join(
        b'{"sku":"SKU-%d","qty":%d,"price":%d0.00,"tax":1.%d0}' % (i, i + 1, i + 1, i)
        for i in range(10)
    )
    invoice = b'{"amount":110.00,"currency":"EUR","reference":"INV-2024-0042","lines":[%s]}' % lines
    # bench.bodies' payment: names with umlauts, as UTF-8 and escaped (`json.dumps`' default)
    utf8 = BODIES["a payment, non-ASCII as UTF-8"]
    escaped = BODIES["a payment, non-ASCII escaped"]
    many = b"[" + b",".join([b"1.5"] * (VALUES - 1)) + b"]"
    objects = b"[" + b",".join([b'{"k":1,"v":2.5,"s":"x"}'] * ((VALUES - 1) // 4)) + b"]"
    return [
        ("typical", "JSON, small (26 B)", request()),
        ("typical", "JSON, payment with lines (216 B)", request(body=payment)),
        ("typical", f"JSON, invoice priced 10.00 ({len(invoice)} B)", request(body=invoice)),
        ("typical", f"JSON, payment, UTF-8 names ({len(utf8)} B)", request(body=utf8)),
        ("typical", f"JSON, payment, escaped names ({len(escaped)} B)", request(body=escaped)),
        (
            "typical",
            "form, 4 fields",
            request(content_type=FORM, body=b"amount=5&currency=EUR&memo=hello+world&to=acc2"),
        ),
        ("typical", "query, 3 params + JSON", request(query_string=b"page=2&sort=name&dir=asc")),
        (
            "typical",
            "multipart, 2 parts (2 KiB)",
            request(content_type=b"multipart/form-data; boundary=Bq7", body=multipart(2, 1000)),
        ),
        ("at the cap", f"JSON, {VALUES - 1} numbers", request(body=many)),
        ("at the cap", f"JSON, {(VALUES - 1) // 4} small objects", request(body=objects)),
        (
            "at the cap",
            "JSON, 1 MiB: one string",
            request(body=pad_json_string(b'{"a":1', b"}")),
        ),
        (
            "at the cap",
            f"JSON, 1 MiB: {VALUES // 2 - 1} strings with commas in them",
            request(body=b"[" + b",".join([b'"' + b"a," * 100 + b'"'] * (VALUES // 2 - 1)) + b"]"),
        ),
        (
            "at the cap",
            f"form, 1 MiB in {FIELDS} fields",
            request(
                content_type=FORM,
                body=b"&".join([b"f%d=" % i + b"x" * (MIB // FIELDS - 8) for i in range(FIELDS)]),
            ),
        ),
        (
            "at the cap",
            f"query, {FIELDS} params of 60 B",
            request(query_string=b"&".join([b"p%d=" % i + b"y" * 55 for i in range(FIELDS)])),
        ),
        (
            "at the cap",
            f"multipart, 1 MiB in {FIELDS} parts",
            request(
                content_type=b"multipart/form-data; boundary=Bq7",
                body=multipart(FIELDS, MIB // FIELDS - 60),
            ),
        ),
        ("refused", "form, 1 MiB of a&a&a...", request(content_type=FORM, body=b"a&" * (MIB // 2))),
        ("refused", "query, 1 MiB of a&a&a...", request(query_string=b"a&" * (MIB // 2))),
        (
            "refused",
            "JSON, 1 MiB of [1,1,1...]",
            request(body=b"[" + b"1," * (MIB // 2 - 1) + b"1]"),
        ),
        (
            "refused",
            'JSON, 1 MiB of ["a,","a,",...]',
            request(body=b"[" + b'"a,",' * (MIB // 5 - 1) + b'""]'),
        ),
    ]


def per_call(call: Callable[[], object]) -> float:
    """Best of 5: microseconds per call, with the loop sized to take about 0.1 s."""
    timer = timeit.Timer(call)
    number, _ = timer.autorange()
    number = max(1, number // 2)
    return min(timer.repeat(repeat=5, number=number)) / number * 1e6


def _no_fast_path(body: bytes, max_values: int) -> None:
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--reference",
        action="store_true",
        help="canonicalise every JSON body on the reference path, without the orjson fast path",
    )
    if parser.parse_args(argv).reference:
        vars(fingerprint_module)["canonical_json_fast"] = _no_fast_path
        print("JSON on the reference path only (--reference)")
    print(f"defaults: max_fields={FIELDS}, max_json_values={VALUES}, max_body_bytes={MIB}")
    print()
    print("| kind | request | body bytes | µs per fingerprint | outcome |")
    print("|---|---|---:|---:|---|")
    for kind, name, args in cases():
        path = {k: v for k, v in args.items() if k not in _PER_REQUEST}
        fingerprinter = Fingerprinter(
            path.pop("operation"), path.pop("path_params"), Policy(**path)
        )
        per_request = tuple(args[k] for k in _PER_REQUEST)

        def call(fingerprinter: Fingerprinter = fingerprinter, req: Any = per_request) -> str:
            try:
                fingerprinter(*req)
            except RequestRejected as exc:
                return exc.kind.value
            return "fingerprint"

        outcome = call()
        size = len(args["body"]) + len(args["query_string"])
        print(f"| {kind} | {name} | {size:,} | {per_call(call):,.1f} | {outcome} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

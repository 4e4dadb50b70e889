"""`python -m bench.auth`: the gateway CPU that the auth check costs per request (route -> scope,
then authorize() against a table of keys), measured as process CPU time over many calls."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from fngate import apikeys
from fngate.errors import FunctionError
from gateway import auth


def per_call_us(call: Callable[[], object], count: int) -> float:
    best = float("inf")
    for _ in range(5):
        started = time.process_time()
        for _ in range(count):
            call()
        best = min(best, (time.process_time() - started) / count * 1e6)
    return best


def refused(table: auth.KeyTable, header: str) -> Callable[[], object]:
    def call() -> object:
        try:
            return table.authorize(header, "invoke", "classifier")
        except FunctionError as exc:
            return exc

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keys", type=int, default=1000, help="keys in the table")
    parser.add_argument("--count", type=int, default=100_000, help="calls per measurement")
    args = parser.parse_args()
    records = []
    headers = {}
    for index in range(args.keys):
        key, ident = apikeys.new_key()
        scopes = ("invoke:classifier*", "read") if index % 2 else ("admin",)
        records.append(apikeys.KeyRecord(ident, apikeys.hash_key(key).hex(), scopes))
        headers[scopes[0]] = f"Bearer {key}"
    key, ident = apikeys.new_key()
    records.append(apikeys.KeyRecord(ident, apikeys.hash_key(key).hex(), ("read",)))
    reader = f"Bearer {key}"
    table = auth.KeyTable()
    table.load(records)
    glob, admin = headers["invoke:classifier*"], headers["admin"]
    cases: dict[str, Callable[[], object]] = {
        "baseline (an empty call)": lambda: None,
        "authorize, invoke:classifier* key": lambda: table.authorize(glob, "invoke", "classifier"),
        "authorize, admin key": lambda: table.authorize(admin, "invoke", "classifier"),
        "refused: unknown key (401)": refused(table, "Bearer fng_0123456789ab_" + "x" * 43),
        "refused: scope missing (403)": refused(table, reader),
    }
    print(f"{args.keys} keys in the table; best of 5 x {args.count} calls, process CPU time")
    for name, call in cases.items():
        print(f"  {name:<36} {per_call_us(call, args.count):6.2f} us")


if __name__ == "__main__":
    main()

"""Auth on the gateway: every route against every kind of caller (no key, a wrong one, each scope, a
revoked one), the pure parts (scopes per route, authorize), and the limits' Lua against real Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import redis as sync_redis
import redis.asyncio as aioredis

from fngate import apikeys, keys
from fngate.cli import main as cli
from fngate.errors import PermissionDenied, RateLimited, Unauthenticated
from gateway import auth, limits
from gateway.http import app as http_app
from gateway.http import invoke
from gateway.http.errors import headers_of, status_of
from gateway.http.guard import Guarded

# (method, route) -> (path, body, who may call it, the status once allowed). Every route of the
# router must be here (test_every_route_of_the_router_has_a_policy), so that a route added without
# a scope fails. Allowed without a runner: the invocations carry an invalid body (400 after auth),
# the admin routes name an unknown function.
INVOKE_CLASSIFIER = {"admin", "invoke", "invoke:classifier"}
READ_CLASSIFIER = {"admin", "read", "invoke", "invoke:classifier"}
ANY_KEY = {"admin", "read", "deploy", "invoke", "invoke:classifier", "invoke:norm*"}
BROWSING = ANY_KEY - {"deploy"}
DEPLOYERS = {"admin", "deploy"}
Policy = tuple[str, bytes, set[str] | None, int]
POLICY: dict[tuple[str, str], Policy] = {
    ("GET", "/v2/health/live"): ("/v2/health/live", b"", None, 200),
    ("HEAD", "/v2/health/live"): ("/v2/health/live", b"", None, 200),
    ("GET", "/v2/health/ready"): ("/v2/health/ready", b"", None, 200),
    ("HEAD", "/v2/health/ready"): ("/v2/health/ready", b"", None, 200),
    ("POST", "/v2/models/{name}/infer"): ("/v2/models/classifier/infer", b"{}", INVOKE_CLASSIFIER, 400),
    ("POST", "/v2/models/{name}/versions/{version}/infer"): (
        "/v2/models/classifier/versions/1/infer",
        b"{}",
        INVOKE_CLASSIFIER,
        400,
    ),
    ("POST", "/v1/functions/{name}"): ("/v1/functions/classifier", b"{}", INVOKE_CLASSIFIER, 400),
    ("POST", "/v2/models/{name}/generate_stream"): (
        "/v2/models/classifier/generate_stream",
        b"{}",
        INVOKE_CLASSIFIER,
        400,
    ),
    ("POST", "/v2/models/{name}/versions/{version}/generate_stream"): (
        "/v2/models/classifier/versions/1/generate_stream",
        b"{}",
        INVOKE_CLASSIFIER,
        400,
    ),
    # OpenAI's: the function is in the body (an invoke key of another function is refused once read).
    ("POST", "/v1/chat/completions"): (
        "/v1/chat/completions",
        b'{"model": "classifier"}',
        INVOKE_CLASSIFIER,
        400,
    ),
    ("POST", "/v1/completions"): ("/v1/completions", b'{"model": "classifier"}', INVOKE_CLASSIFIER, 400),
    ("GET", "/v1/models"): ("/v1/models", b"", BROWSING, 200),
    ("HEAD", "/v1/models"): ("/v1/models", b"", BROWSING, 200),
    ("GET", "/v1/models/{name}"): (
        "/v1/models/classifier",
        b"",
        READ_CLASSIFIER,
        404,
    ),  # not a text generator
    ("HEAD", "/v1/models/{name}"): ("/v1/models/classifier", b"", READ_CLASSIFIER, 404),
    ("GET", "/v2"): ("/v2", b"", ANY_KEY, 200),  # name, version, extensions: perf_analyzer reads them
    ("HEAD", "/v2"): ("/v2", b"", ANY_KEY, 200),
    ("GET", "/v2/"): ("/v2/", b"", ANY_KEY, 200),
    ("HEAD", "/v2/"): ("/v2/", b"", ANY_KEY, 200),
    ("GET", "/v2/models/stats"): ("/v2/models/stats", b"", BROWSING, 200),
    ("HEAD", "/v2/models/stats"): ("/v2/models/stats", b"", BROWSING, 200),
    ("GET", "/v1/functions"): ("/v1/functions", b"", {"admin", "read"}, 200),
    ("HEAD", "/v1/functions"): ("/v1/functions", b"", {"admin", "read"}, 200),
    ("POST", "/v2/repository/index"): ("/v2/repository/index", b"", {"admin", "read"}, 200),
    ("POST", "/v2/repository/models/{name}/load"): ("/v2/repository/models/nope/load", b"", {"admin"}, 404),
    ("POST", "/v2/repository/models/{name}/unload"): (
        "/v2/repository/models/nope/unload",
        b"",
        {"admin"},
        404,
    ),
    ("GET", "/metrics"): ("/metrics", b"", {"admin"}, 200),
    ("HEAD", "/metrics"): ("/metrics", b"", {"admin"}, 200),
    ("PUT", "/v1/functions/{name}"): ("/v1/functions/nope", b"", DEPLOYERS, 400),
    ("GET", "/v1/functions/{name}"): ("/v1/functions/nope", b"", DEPLOYERS, 404),
    ("HEAD", "/v1/functions/{name}"): ("/v1/functions/nope", b"", DEPLOYERS, 404),
    ("DELETE", "/v1/functions/{name}"): ("/v1/functions/nope", b"", DEPLOYERS, 404),
    ("PUT", "/v1/functions/{name}/traffic"): ("/v1/functions/nope/traffic", b"", DEPLOYERS, 400),
    ("GET", "/v1/invocations/{id}"): ("/v1/invocations/" + "0" * 32, b"", ANY_KEY, 404),
    ("HEAD", "/v1/invocations/{id}"): ("/v1/invocations/" + "0" * 32, b"", ANY_KEY, 404),
    ("DELETE", "/v1/invocations/{id}"): ("/v1/invocations/" + "0" * 32, b"", ANY_KEY, 404),
}
for _suffix in ("", "/ready", "/config", "/stats"):
    for _method in ("GET", "HEAD"):
        POLICY[(_method, "/v2/models/{name}" + _suffix)] = (
            "/v2/models/classifier" + _suffix,
            b"",
            READ_CLASSIFIER,
            200,
        )
        POLICY[(_method, "/v2/models/{name}/versions/{version}" + _suffix)] = (
            "/v2/models/classifier/versions/1" + _suffix,
            b"",
            READ_CLASSIFIER,
            200,
        )
# Shared memory regions: any key that may invoke some function (off in this gateway, so a
# registration is refused after auth; listing answers).
INVOKERS = {"admin", "invoke", "invoke:classifier", "invoke:norm*"}
for _kind, _registered in (("system", 400), ("cuda", 400)):
    _base = f"/v2/{_kind}sharedmemory"
    for _method in ("GET", "HEAD"):
        POLICY[(_method, _base + "/status")] = (_base + "/status", b"", INVOKERS, 200)
        POLICY[(_method, _base + "/region/{region}/status")] = (
            _base + "/region/r/status",
            b"",
            INVOKERS,
            404,
        )
    POLICY[("POST", _base + "/region/{region}/register")] = (
        _base + "/region/r/register",
        b'{"key": "/r", "byte_size": 8}',
        INVOKERS,
        _registered,
    )
    _unregistered = 400 if _kind == "system" else 200
    POLICY[("POST", _base + "/unregister")] = (_base + "/unregister", b"", INVOKERS, _unregistered)
    POLICY[("POST", _base + "/region/{region}/unregister")] = (
        _base + "/region/r/unregister",
        b"",
        INVOKERS,
        _unregistered,
    )
# Not routes: what the router answers past them, also only to a caller with a key.
UNROUTED: list[Policy] = [
    ("/nowhere", b"", ANY_KEY, 404),
    ("/v2/health/live/x", b"", ANY_KEY, 404),
]


def router_routes() -> set[tuple[str, str]]:
    """(method, path) of every route the gateway's HTTP router serves."""
    found = {("POST", route.path) for route in invoke.ROUTES}
    for route in http_app.ROUTES:
        assert isinstance(route, Guarded), f"{route.path} is not a Guarded route: it checks no scope"
        found |= {(method, route.path) for method in route.methods or ()}
    return found


def test_every_route_of_the_router_has_a_policy() -> None:
    routes = router_routes()
    assert routes - POLICY.keys() == set(), "routes without a policy in this test"
    assert POLICY.keys() - routes == set(), "policies of routes that are gone"


SCOPES = ["invoke", "invoke:classifier", "invoke:norm*", "read", "deploy", "admin"]
WRONG = "fng_0123456789ab_" + "x" * 43


def create_key(redis_url: str, *scopes: str, **limits: Any) -> tuple[str, apikeys.KeyRecord]:
    client = sync_redis.Redis.from_url(redis_url)
    try:
        return apikeys.create(client, list(scopes), **limits)
    finally:
        client.close()


async def wait_refused(client: httpx.AsyncClient, key: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while (await client.get("/v1/functions", headers=bearer(key))).status_code != 401:
        assert time.monotonic() < deadline, "the revoked key was still accepted"
        await asyncio.sleep(0.05)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_every_route_against_every_caller(
    redis: aioredis.Redis, redis_url: str, serve_gateway: Callable[..., Any]
) -> None:
    base = await serve_gateway(auth=True, auth_refresh_s=0.1, load_timeout_s=1)
    created = {scope: create_key(redis_url, scope)[0] for scope in SCOPES}
    revoked, record = create_key(redis_url, "admin")
    callers: dict[str, dict[str, str]] = {
        "no key": {},
        "wrong key": bearer(WRONG),
        "not bearer": {"Authorization": "Basic dXNlcjpwYXNz"},
        "revoked": bearer(revoked),
        **{scope: bearer(key) for scope, key in created.items()},
    }
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        # New keys are seen within the refresh interval; a revoked one is refused as quickly.
        deadline = time.monotonic() + 10
        while (await http.get("/v1/functions", headers=callers["revoked"])).status_code != 200:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        client = sync_redis.Redis.from_url(redis_url)
        apikeys.revoke(client, record.id)
        client.close()
        await wait_refused(http, revoked)
        failures = []
        cases = [(method, *policy) for (method, _), policy in POLICY.items()]
        cases += [("GET", *policy) for policy in UNROUTED] + [("PATCH", "/v1/functions/x", b"", ANY_KEY, 405)]
        for method, path, body, allowed, status in cases:
            for caller, headers in callers.items():
                response = await http.request(method, path, content=body, headers=headers)
                if allowed is None or caller in allowed:
                    expected = status
                elif caller in SCOPES:
                    expected = 403
                else:
                    expected = 401
                if response.status_code != expected:
                    failures.append(f"{method} {path} as {caller}: {response.status_code}, wanted {expected}")
                    continue
                if expected in (401, 403) and method != "HEAD":
                    doc = response.json()
                    if isinstance(doc["error"], dict):  # OpenAI's shape, on its routes
                        doc = doc["error"]
                    assert doc["code"] == ("unauthenticated" if expected == 401 else "permission_denied")
                    assert all(key not in response.text for key in [*created.values(), revoked, WRONG])
                if expected == 401:
                    assert response.headers["www-authenticate"].startswith("Bearer")
        # The statistics of all functions list only those the key may read.
        stats = await http.get("/v2/models/stats", headers=callers["invoke:norm*"])
        assert {entry["name"] for entry in stats.json()["model_stats"]} == {"normalize"}
        stats = await http.get("/v2/models/stats", headers=callers["read"])
        assert {"classifier", "normalize"} <= {entry["name"] for entry in stats.json()["model_stats"]}
    assert failures == []


async def test_403_names_the_scope_the_key_lacks(
    redis: aioredis.Redis, redis_url: str, serve_gateway: Callable[..., Any]
) -> None:
    key, record = create_key(redis_url, "invoke:norm*")
    base = await serve_gateway(auth=True)  # reads the keys as it starts
    async with httpx.AsyncClient(base_url=base) as http:
        response = await http.post("/v1/functions/classifier", json={}, headers=bearer(key))
        assert response.status_code == 403
        assert response.json()["error"] == f"the API key {record.id} lacks the scope invoke:classifier"
        response = await http.post("/v2/repository/models/classifier/unload", headers=bearer(key))
        assert response.json()["error"] == f"the API key {record.id} lacks the scope admin"


def table_with(*scopes: str) -> tuple[auth.KeyTable, str]:
    key, ident = apikeys.new_key()
    table = auth.KeyTable()
    table.load([apikeys.KeyRecord(ident, apikeys.hash_key(key).hex(), scopes)])
    return table, key


@pytest.mark.parametrize(
    ("scopes", "scope", "function", "allowed"),
    [
        (("invoke",), "invoke", "anything", True),
        (("invoke:clas*",), "invoke", "classifier", True),
        (("invoke:clas*",), "invoke", "normalize", False),
        (("invoke:a", "invoke:b?"), "invoke", "bc", True),
        (("invoke:a",), "invoke", "ab", False),
        (("invoke:a",), "read", "a", True),
        (("invoke:a",), "read", None, False),
        (("read",), "invoke", "a", False),
        (("read",), "deploy", None, False),
        (("deploy",), "deploy", None, True),
        (("admin",), "invoke", "a", True),
        (("admin",), "deploy", None, True),
        (("deploy",), "", None, True),
    ],
)
def test_authorize_checks_the_scope(
    scopes: tuple[str, ...], scope: str, function: str | None, allowed: bool
) -> None:
    table, key = table_with(*scopes)
    if allowed:
        assert table.authorize(f"Bearer {key}", scope, function).scopes <= set(scopes)
    else:
        with pytest.raises(PermissionDenied):
            table.authorize(f"Bearer {key}", scope, function)


@pytest.mark.parametrize(
    "header",
    [None, "", "Bearer", "Bearer ", "Basic abc", "Bearer fng_", "Bearer nonsense", f"Bearer {WRONG}"],
)
def test_authorize_refuses_missing_and_unknown_keys(header: str | None) -> None:
    table, _ = table_with("admin")
    with pytest.raises(Unauthenticated) as raised:
        table.authorize(header, "read")
    assert status_of(raised.value) == 401 and "WWW-Authenticate" in headers_of(raised.value, 1)


def test_a_key_with_a_known_id_and_another_secret_is_refused() -> None:
    table, key = table_with("admin")
    forged = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
    with pytest.raises(Unauthenticated):
        table.authorize(f"Bearer {forged}", "read")
    assert table.authorize(f"bearer {key}", "read").key_id == apikeys.key_id(key)


def test_scopes_are_checked_when_a_key_is_created() -> None:
    for good in ["invoke", "invoke:classifier*", "read", "deploy", "admin"]:
        assert apikeys.check_scope(good) == good
    for bad in ["write", "read:x", "invoke:", "invoke:A B", "admin:*"]:
        with pytest.raises(apikeys.InvalidArgument):
            apikeys.check_scope(bad)


def principal(rps: float = 0, burst: int = 0, max_in_flight: int = 0, max_queued: int = 0) -> auth.Principal:
    record = apikeys.KeyRecord(
        "0123456789ab",
        "00" * 32,
        ("invoke",),
        rps=rps,
        burst=burst,
        max_in_flight=max_in_flight,
        max_queued=max_queued,
    )
    return auth.principal_of(record)


async def admit(
    client: aioredis.Redis, who: auth.Principal, member: str, ttl_ms: int = 60_000, function: str = "f"
) -> list[Any]:
    admit = limits.admission(who, function, member, ttl_ms)
    outcome: list[Any] = await client.eval(limits.ADMIT_SCRIPT, 3, *admit.keys, *admit.args)  # type: ignore[misc]
    return outcome


async def test_the_rate_limit_allows_the_burst_then_refuses_with_a_retry_time(redis: aioredis.Redis) -> None:
    who = principal(rps=0.01, burst=3)
    outcomes = [await admit(redis, who, f"m{index}") for index in range(5)]
    assert [outcome[0] for outcome in outcomes] == [b"ok", b"ok", b"ok", b"rate", b"rate"]
    with pytest.raises(RateLimited) as raised:
        limits.admitted(who, "f", outcomes[3])
    assert status_of(raised.value) == 429 and int(headers_of(raised.value, 1)["Retry-After"]) >= 99
    assert await redis.pttl(keys.key_rate(who.key_id)) > 0  # the bucket does not outlive its use


async def test_tokens_come_back_at_the_rate(redis: aioredis.Redis) -> None:
    who = principal(rps=1000, burst=1)
    assert (await admit(redis, who, "a"))[0] == b"ok"
    await asyncio.sleep(0.01)  # ten tokens' worth, one kept (the burst)
    assert (await admit(redis, who, "b"))[0] == b"ok"


async def test_the_in_flight_cap_counts_until_released_or_expired(redis: aioredis.Redis) -> None:
    who = principal(max_in_flight=2)
    assert [(await admit(redis, who, m))[0] for m in ("a", "b", "c")] == [b"ok", b"ok", b"busy"]
    await redis.zrem(keys.key_in_flight(who.key_id), "a")  # what Limiter.release does
    assert (await admit(redis, who, "d"))[0] == b"ok"
    # A dead gateway's invocations lapse at their expiry.
    await redis.delete(keys.key_in_flight(who.key_id))
    assert [(await admit(redis, who, m, ttl_ms=50))[0] for m in ("e", "f")] == [b"ok", b"ok"]
    assert (await admit(redis, who, "g"))[0] == b"busy"
    await asyncio.sleep(0.1)
    assert (await admit(redis, who, "h"))[0] == b"ok"


async def test_a_key_holds_at_most_its_share_of_each_function_queue(redis: aioredis.Redis) -> None:
    who = principal(max_queued=1)
    assert (await admit(redis, who, "a", function="f"))[0] == b"ok"
    refused = await admit(redis, who, "b", function="f")
    assert refused[0] == b"share"
    with pytest.raises(RateLimited, match="invocations of 'f' queued or running"):
        limits.admitted(who, "f", refused)
    assert (await admit(redis, who, "c", function="g"))[0] == b"ok"  # another function's queue


async def test_a_refused_invocation_takes_neither_a_token_nor_a_slot(redis: aioredis.Redis) -> None:
    who = principal(rps=0.01, burst=1, max_in_flight=1)
    assert (await admit(redis, who, "a"))[0] == b"ok"
    await redis.zrem(keys.key_in_flight(who.key_id), "a")
    assert (await admit(redis, who, "b"))[0] == b"rate"
    assert await redis.zcard(keys.key_in_flight(who.key_id)) == 0


async def test_the_key_table_reloads_when_keys_change_and_survives_an_outage(
    redis: aioredis.Redis, redis_url: str
) -> None:
    table = auth.KeyTable(refresh_s=0.05)
    key, record = create_key(redis_url, "read")
    assert await table.refresh(redis)
    assert not await table.refresh(redis)  # nothing changed: one GET, no reload
    assert table.authorize(f"Bearer {key}", "read").key_id == record.id
    broken = aioredis.from_url("redis://127.0.0.1:1", socket_connect_timeout=0.2)
    task = asyncio.create_task(table.run(broken))
    await asyncio.sleep(0.3)
    assert not table.healthy
    assert table.authorize(f"Bearer {key}", "read").key_id == record.id  # the last table stays
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await broken.aclose()


async def test_an_admin_key_from_settings_is_accepted_whatever_redis_holds(
    redis: aioredis.Redis,
    serve_gateway: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    key, ident = apikeys.new_key()
    monkeypatch.setenv("FNGATE_API_KEY", key)
    assert cli.main(["keys", "hash"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"{ident}:") and key not in line
    other, _ = apikeys.new_key()
    base = await serve_gateway(auth=True, admin_key_hash=f"{line},{apikeys.hash_line(other)}")
    async with httpx.AsyncClient(base_url=base) as http:
        assert (await http.post("/v2/repository/index", headers=bearer(key))).status_code == 200
        assert (await http.get("/metrics", headers=bearer(other))).status_code == 200
        assert (
            await http.post(
                "/v2/repository/index", headers=bearer(key[:-1] + ("A" if key[-1] != "A" else "B"))
            )
        ).status_code == 401


async def test_a_new_key_works_at_once_on_every_route_kind(
    redis: aioredis.Redis, redis_url: str, serve_gateway: Callable[..., Any]
) -> None:
    """The gateway refreshes its keys only every minute here: a key created after it started is
    looked up when it is first met (an invocation, another route, an unknown path)."""
    base = await serve_gateway(auth=True, auth_refresh_s=60)
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        for method, path, status in [
            ("POST", "/v1/functions/classifier", 400),  # the invocation path, its body invalid
            ("GET", "/v1/functions", 200),
            ("GET", "/nowhere", 404),
        ]:
            key, _ = create_key(redis_url, "admin")
            response = await http.request(method, path, content=b"{}", headers=bearer(key))
            assert response.status_code == status, (path, response.text)
        unknown = await http.get("/v1/functions", headers=bearer("fng_0123456789ab_" + "y" * 43))
        assert unknown.status_code == 401

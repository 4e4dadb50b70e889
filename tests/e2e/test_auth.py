"""Auth with real processes: per-key limits that hold in total across two gateway processes, a
revocation that every gateway sees, no key in logs or traces, the deploy API to a folder and to S3,
and tritonclient (sync and asyncio) sending the key."""

from __future__ import annotations

import asyncio
import gzip
import io
import os
import tarfile
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis.asyncio as aioredis
import tritonclient.http as triton
import tritonclient.http.aio as triton_aio
from tritonclient.utils import InferenceServerException

from fngate import apikeys, clients, keys
from fngate.config import GatewaySettings
from gateway.http.metrics_port import MetricsPort
from tests.conftest import ROOT, wait_http
from tests.e2e.deployments import cli, invoke, runner_env, scale_function
from tests.e2e.test_observability import Receiver, receiver
from tests.s3 import Bucket

__all__ = ["receiver"]
CLASSIFIER = {"inputs": {"input": [[0.5] * 16]}}
PROBE = {"inputs": {"x": [[1.0, 2.0, 3.0, 4.0]]}}
NO_AWS = {"AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}


def create_key(redis_url: str, *scopes: str, **limits: Any) -> tuple[str, apikeys.KeyRecord]:
    client = clients.connect_sync(redis_url)
    try:
        return apikeys.create(client, list(scopes), **limits)
    finally:
        client.close()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def start_gateways(gateway_process: Callable[..., str], count: int, **env: str) -> list[str]:
    bases = [gateway_process(FNGATE_AUTH="true", FNGATE_AUTH_REFRESH_S="0.2", **env) for _ in range(count)]
    for base in bases:
        await wait_http(base)
    return bases


async def warm_up(client: httpx.AsyncClient, base: str, function: str, body: Any, admin: str) -> None:
    """Until the runner answers (its cold start can outlast the function's timeout)."""
    deadline = time.monotonic() + 60
    while True:
        response = await client.post(f"{base}/v1/functions/{function}", json=body, headers=bearer(admin))
        if response.status_code == 200:
            return
        assert time.monotonic() < deadline, response.text
        await asyncio.sleep(0.2)


async def test_the_rate_limit_holds_in_total_across_two_gateways(
    redis: aioredis.Redis,
    redis_url: str,
    gateway_process: Callable[..., str],
    runner_process: Callable[..., Any],
) -> None:
    # One token per 100 s: within this test the key gets its burst of 4 and no more.
    limited, _ = create_key(redis_url, "invoke:classifier", rps=0.01, burst=4)
    admin, _ = create_key(redis_url, "admin")
    bases = await start_gateways(gateway_process, 2)
    runner_process(FNGATE_FUNCTIONS='["classifier"]')
    statuses = []
    async with httpx.AsyncClient(timeout=60) as client:
        await warm_up(client, bases[0], "classifier", CLASSIFIER, admin)
        for index in range(10):
            response = await client.post(
                f"{bases[index % 2]}/v1/functions/classifier", json=CLASSIFIER, headers=bearer(limited)
            )
            statuses.append(response.status_code)
            if response.status_code == 429:
                assert int(response.headers["retry-after"]) >= 1
                assert response.json()["code"] == "rate_limited"
    assert statuses.count(200) == 4 and statuses.count(429) == 6, statuses


async def test_the_in_flight_cap_holds_in_total_and_frees_slots_when_answered(
    redis: aioredis.Redis,
    redis_url: str,
    gateway_process: Callable[..., str],
    runner_process: Callable[..., Any],
) -> None:
    admin, _ = create_key(redis_url, "admin")
    capped, record = create_key(redis_url, "invoke:probe", max_in_flight=2)
    bases = await start_gateways(gateway_process, 2)
    runner_process(FNGATE_FUNCTIONS='["probe"]', PROBE_SLEEP_S="2")
    async with httpx.AsyncClient(timeout=60) as client:
        await warm_up(client, bases[0], "probe", PROBE, admin)

        async def call(index: int) -> httpx.Response:
            await asyncio.sleep(0.2 * (index >= 2))  # the first two are in flight before the rest arrive
            return await client.post(
                f"{bases[index % 2]}/v1/functions/probe", json=PROBE, headers=bearer(capped)
            )

        responses = await asyncio.gather(*(call(index) for index in range(6)))
        statuses = sorted(response.status_code for response in responses)
        assert statuses == [200, 200, 429, 429, 429, 429], [r.text for r in responses]
        refused = next(response for response in responses if response.status_code == 429)
        assert refused.json()["code"] == "rate_limited" and int(refused.headers["retry-after"]) >= 1
        # Answered invocations left the key's in-flight set: the key may call again.
        assert await redis.zcard(keys.key_in_flight(record.id)) == 0
        again = await client.post(f"{bases[1]}/v1/functions/probe", json=PROBE, headers=bearer(capped))
        assert again.status_code == 200


async def test_a_revocation_is_seen_by_every_gateway_and_no_key_is_logged_or_traced(
    redis: aioredis.Redis,
    redis_url: str,
    gateway_process: Callable[..., str],
    runner_process: Callable[..., Any],
    receiver: tuple[Receiver, str],
    tmp_path: Path,
) -> None:
    spans, endpoint = receiver
    key, record = create_key(redis_url, "invoke", "read")
    bases = await start_gateways(
        gateway_process, 2, OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_BSP_SCHEDULE_DELAY="100"
    )
    runner_process(FNGATE_FUNCTIONS='["classifier"]')
    async with httpx.AsyncClient(timeout=60) as client:
        for base in bases:
            await warm_up(client, base, "classifier", CLASSIFIER, key)
            assert (
                await client.post(f"{base}/v1/functions/classifier", json=CLASSIFIER, headers=bearer(key))
            ).status_code == 200
            assert (
                await client.post(f"{base}/v1/functions/classifier", json={}, headers=bearer(key))
            ).status_code == 400
            assert (
                await client.post(f"{base}/v2/repository/models/x/unload", headers=bearer(key))
            ).status_code == 403
            wrong = key[:-6] + "AAAAAA"
            assert (await client.get(f"{base}/v1/functions", headers=bearer(wrong))).status_code == 401
        revoked = await cli("keys", "revoke", record.id, "--redis", redis_url)
        assert revoked.returncode == 0, revoked.stderr
        deadline = time.monotonic() + 10
        for base in bases:
            while (await client.get(f"{base}/v1/functions", headers=bearer(key))).status_code != 401:
                assert time.monotonic() < deadline, f"{base} still accepts a revoked key"
                await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)  # the span exporters' schedule
    assert spans.named("POST"), "no server span was exported"
    secret = key.split("_", 2)[2]  # fng_<id>_<secret>: the secret may hold "_" itself
    exported = repr(spans.spans)
    assert secret not in exported and "Bearer" not in exported
    logs = await asyncio.to_thread(read_logs, tmp_path)
    assert any(name.startswith("gateway-") for name in logs)
    for name, text in logs.items():
        assert secret not in text, name


def read_logs(folder: Path) -> dict[str, str]:
    return {path.name: path.read_text(errors="replace") for path in folder.glob("*.log")}


async def test_deploy_through_the_api_to_a_folder_then_invoke_and_remove(
    redis: aioredis.Redis,
    redis_url: str,
    gateway_process: Callable[..., str],
    runner_process: Callable[..., Any],
    tmp_path: Path,
) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    deployer, _ = create_key(redis_url, "deploy")
    caller, _ = create_key(redis_url, "invoke:scale")
    (base,) = await start_gateways(gateway_process, 1, FNGATE_REPO=str(repo), FNGATE_CATALOG_REFRESH_S="0.2")
    runner_process(**runner_env(str(repo), tmp_path / "artifacts"))
    manifest = scale_function(tmp_path / "v1", "scale", 2.0)

    refused = await cli("deploy", str(manifest), "--gateway", base, env={"FNGATE_API_KEY": caller})
    assert refused.returncode == 1 and "403" in refused.stderr and "deploy" in refused.stderr
    missing = await cli("deploy", str(manifest), "--gateway", base)
    assert missing.returncode == 2 and "FNGATE_API_KEY" in missing.stderr
    assert not any(repo.iterdir())

    deployed = await cli("deploy", str(manifest), "--gateway", base, env={"FNGATE_API_KEY": deployer})
    assert deployed.returncode == 0, deployed.stderr
    assert "deployed scale version 1 through" in deployed.stdout
    assert (repo / "scale" / "1" / "model.py").is_file() and (repo / "scale" / "1.json").is_file()
    async with httpx.AsyncClient(base_url=base, timeout=30, headers=bearer(caller)) as client:
        response = await invoke(client, "/v1/functions/scale")
        assert response.status_code == 200, response.text
        assert response.json()["outputs"]["y"] == [[2.0, 4.0]]
        assert (await client.get("/v1/functions/scale")).status_code == 403
        described = await client.get("/v1/functions/scale", headers=bearer(deployer))
        assert described.status_code == 200
        assert [entry["version"] for entry in described.json()["versions"]] == ["1"]
        removed = await client.delete("/v1/functions/scale", headers=bearer(deployer))
        assert removed.status_code == 200 and removed.json()["versions"] == ["1"]
        assert not (repo / "scale").exists()
        gone = await client.get("/v1/functions/scale", headers=bearer(deployer))
        assert gone.status_code == 404


async def test_deploy_through_the_api_to_s3_then_invoke(
    redis: aioredis.Redis,
    redis_url: str,
    gateway_process: Callable[..., str],
    runner_process: Callable[..., Any],
    s3: Bucket,
    tmp_path: Path,
) -> None:
    deployer, _ = create_key(redis_url, "deploy")
    caller, _ = create_key(redis_url, "invoke")
    (base,) = await start_gateways(
        gateway_process, 1, FNGATE_REPO=s3.repo, FNGATE_CATALOG_REFRESH_S="0.2", **s3.env
    )
    runner_process(**runner_env(s3.repo, tmp_path / "artifacts", s3.env))
    manifest = scale_function(tmp_path / "v1", "scale", 3.0)
    # The deployer has neither S3 nor Redis settings: only the gateway's address and a key.
    deployed = await cli(
        "deploy", str(manifest), "--gateway", base, env={"FNGATE_API_KEY": deployer, **NO_AWS}
    )
    assert deployed.returncode == 0, deployed.stderr
    stored = s3.client().list_objects_v2(Bucket=s3.name, Prefix=s3.key("scale"))
    assert s3.key("scale", "1", "model.py") in {item["Key"] for item in stored["Contents"]}
    async with httpx.AsyncClient(base_url=base, timeout=30, headers=bearer(caller)) as client:
        response = await invoke(client, "/v1/functions/scale")
        assert response.status_code == 200, response.text
        assert response.json()["outputs"]["y"] == [[3.0, 6.0]]


async def test_a_deploy_over_the_size_limit_is_refused(
    redis: aioredis.Redis, redis_url: str, serve_gateway: Callable[..., Any], tmp_path: Path
) -> None:
    deployer, _ = create_key(redis_url, "deploy")
    base = await serve_gateway(auth=True, repo=str(tmp_path), max_deploy_bytes=4096)
    async with httpx.AsyncClient(base_url=base, headers=bearer(deployer)) as client:
        response = await client.put("/v1/functions/big", content=b"\0" * 10_000)
        assert response.status_code == 413

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: the gateway counts
            for _ in range(3):
                yield b"\0" * 3000

        streamed = await client.put("/v1/functions/big", content=chunks())
        assert streamed.status_code == 413
        garbage = await client.put("/v1/functions/big", content=b"not a tar")
        assert garbage.status_code == 400 and "tar.gz" in garbage.json()["error"]
        # A small archive of zeros that unpacks to 1 GiB: refused from its header, nothing unpacked.
        scratch = await asyncio.to_thread(deploy_scratch)
        info = tarfile.TarInfo("model.onnx")
        info.size = 1024**3
        bomb = gzip.compress(info.tobuf() + bytes(1024 * 1024), compresslevel=9)
        assert len(bomb) < 4096
        response = await client.put("/v1/functions/big", content=bomb)
        assert response.status_code == 413 and "unpacks to more than" in response.json()["error"]
        assert await asyncio.to_thread(deploy_scratch) <= scratch
        # A folder without its model: refused in the caller's words, not the gateway's scratch paths.
        manifest = (ROOT / "functions" / "classifier" / "function.yaml").read_bytes()
        info = tarfile.TarInfo("function.yaml")
        info.size = len(manifest)
        packed = io.BytesIO()
        with tarfile.open(fileobj=packed, mode="w:gz") as tar:
            tar.addfile(info, io.BytesIO(manifest))
        response = await client.put("/v1/functions/classifier", content=packed.getvalue())
        error = response.json()["error"]
        assert response.status_code == 400 and "model.onnx does not exist" in error, error
        assert tempfile.gettempdir() not in error and "fngate-deploy" not in error, error
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("name", "kind", "refused"),
    [
        ("../escaped.yaml", tarfile.REGTYPE, "outside its folder"),
        ("/tmp/escaped.yaml", tarfile.REGTYPE, "outside its folder"),
        ("sub/../../escaped.yaml", tarfile.REGTYPE, "outside its folder"),
        ("link", tarfile.SYMTYPE, "not a file or folder"),
        ("fifo", tarfile.FIFOTYPE, "not a file or folder"),
    ],
)
async def test_an_archive_member_outside_its_folder_or_not_a_file_is_refused(
    redis_url: str, serve_gateway: Callable[..., Any], tmp_path: Path, name: str, kind: bytes, refused: str
) -> None:
    # The gateway writes each member itself (the images' Python 3.11.2 has no tarfile filter): a
    # name that climbs out, an absolute one, a link or a device is refused, and nothing is written.
    deployer, _ = create_key(redis_url, "deploy")
    repo = tmp_path / "repo"
    repo.mkdir()
    base = await serve_gateway(auth=True, repo=str(repo))
    packed = io.BytesIO()
    with tarfile.open(fileobj=packed, mode="w:gz") as tar:
        info = tarfile.TarInfo(name)
        info.type = kind
        info.linkname = "/etc/passwd" if kind == tarfile.SYMTYPE else ""
        tar.addfile(info, io.BytesIO(b"") if kind == tarfile.REGTYPE else None)
    async with httpx.AsyncClient(base_url=base, headers=bearer(deployer)) as client:
        response = await client.put("/v1/functions/classifier", content=packed.getvalue())
    assert response.status_code == 400 and refused in response.json()["error"], response.text
    assert os.listdir(repo) == []
    assert os.listdir(tmp_path) == ["repo"] and "escaped.yaml" not in os.listdir("/tmp")


def deploy_scratch() -> set[Path]:
    """The deploy API's scratch folders that exist now."""
    return set(Path(tempfile.gettempdir()).glob("fngate-deploy-*"))


def triton_calls(url: str, key: str) -> None:
    client = triton.InferenceServerClient(url.removeprefix("http://"))
    try:
        headers = bearer(key)
        assert client.is_server_live()  # health stays open
        with pytest.raises(InferenceServerException, match="API key"):
            client.get_model_metadata("classifier")
        assert client.is_model_ready("classifier", headers=headers)
        assert client.get_model_metadata("classifier", headers=headers)["name"] == "classifier"
        batch = np.full((2, 16), 0.5, dtype=np.float32)
        tensor = triton.InferInput("input", [2, 16], "FP32")
        tensor.set_data_from_numpy(batch, binary_data=True)
        result = client.infer("classifier", [tensor], headers=headers)
        assert result.as_numpy("probabilities").shape == (2, 4)
        with pytest.raises(InferenceServerException, match="API key"):
            client.infer("classifier", [tensor])
    finally:
        client.close()


async def test_tritonclient_sync_and_asyncio_send_the_key(
    redis: aioredis.Redis,
    redis_url: str,
    serve_gateway: Callable[..., Any],
    inprocess_runner: Callable[..., Any],
) -> None:
    key, _ = create_key(redis_url, "invoke:classifier")
    base = await serve_gateway(auth=True)
    await inprocess_runner(functions=("classifier",))
    await asyncio.to_thread(triton_calls, base, key)
    client = triton_aio.InferenceServerClient(base.removeprefix("http://"))
    try:
        tensor = triton_aio.InferInput("input", [1, 16], "FP32")
        tensor.set_data_from_numpy(np.full((1, 16), 0.5, dtype=np.float32))
        result = await client.infer("classifier", [tensor], headers=bearer(key))
        assert result.as_numpy("probabilities").shape == (1, 4)
        assert await client.is_model_ready("classifier", headers=bearer(key))
        with pytest.raises(InferenceServerException, match="API key"):
            await client.infer("classifier", [tensor])
    finally:
        await client.close()


def compute_seconds(function: str) -> float:
    """The in-process runner's own busy time for `function` (fngate_compute_duration_seconds)."""
    from prometheus_client import REGISTRY

    return float(
        REGISTRY.get_sample_value("fngate_compute_duration_seconds_sum", {"function": function}) or 0.0
    )


async def test_each_keys_share_of_mixed_batches_adds_up_to_the_runners_busy_time(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], redis_url: str, tmp_path: Path
) -> None:
    """Four keys call one function at once, their invocations batched together: each batch's time is
    split over them by rows, and what the keys are charged adds up to the runner's busy time within
    2%; `fngate keys usage` and the metrics port report it per key."""
    base = await serve_gateway(auth=True, auth_refresh_s=0.2)
    await inprocess_runner()
    made = [create_key(redis_url, "invoke:classifier", name=f"tenant-{index}") for index in range(4)]
    before = compute_seconds("classifier")
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        await warm_up(client, base, "classifier", CLASSIFIER, made[0][0])

        async def calls(key: str, rows: int) -> None:
            body = {"inputs": {"input": [[0.5] * 16] * rows}}
            for _ in range(25):
                answer = await client.post("/v1/functions/classifier", json=body, headers=bearer(key))
                assert answer.status_code == 200, answer.text

        await asyncio.gather(*(calls(key, rows) for (key, _), rows in zip(made, (1, 2, 3, 4), strict=True)))
    busy = compute_seconds("classifier") - before

    def charged_now() -> dict[str, float]:
        with clients.connect_sync(redis_url) as sync:
            return {
                record.id: sum(float(seconds) for seconds in sync.hgetall(keys.key_usage(record.id)).values())
                for _, record in made
            }

    charged = charged_now()
    for _ in range(40):  # a runner adds what it charged to Redis once a second
        if abs(sum(charged.values()) - busy) <= 0.02 * busy:
            break
        await asyncio.sleep(0.1)
        charged = charged_now()
    assert all(seconds > 0 for seconds in charged.values()), charged
    assert abs(sum(charged.values()) - busy) <= 0.02 * busy, (charged, busy)
    listed = await cli("keys", "usage", "--minutes", "5", "--redis", redis_url)
    assert listed.returncode == 0, listed.stderr
    for _, record in made:
        assert any(line.startswith(record.id) and "classifier" in line for line in listed.stdout.splitlines())
    port = MetricsPort(GatewaySettings(redis_url=redis_url, repo=str(ROOT / "functions")))
    try:
        scraped = (await port.scrape()).decode()
    finally:
        await port.aclose()
    for _, record in made:
        assert f'fngate_key_compute_seconds_total{{function="classifier",key_id="{record.id}"}}' in scraped


async def test_a_keys_cpu_time_is_what_its_calls_took_in_the_functions_process(
    serve_gateway: Callable[..., Any],
    inprocess_runner: Callable[..., Any],
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """probe spins until its process has taken 40 ms of CPU, then sleeps 40 ms, a batch: a key's
    calls are charged that CPU time (read by the runner from the kernel's clock of the function's
    process, not reported by its code), about half their batch time, and `fngate keys usage` and the
    metrics port report both."""
    monkeypatch.setenv("PROBE_SPIN_S", "0.04")
    monkeypatch.setenv("PROBE_SLEEP_S", "0.04")
    base = await serve_gateway(auth=True, auth_refresh_s=0.2)
    await inprocess_runner()
    (warming, _), (key, record) = create_key(redis_url, "invoke:probe"), create_key(redis_url, "invoke:probe")
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        await warm_up(client, base, "probe", PROBE, warming)
        for _ in range(5):  # one at a time: each its own batch
            answer = await client.post("/v1/functions/probe", json=PROBE, headers=bearer(key))
            assert answer.status_code == 200, answer.text

    def charged_now() -> tuple[float, float]:
        with clients.connect_sync(redis_url) as sync:
            wall = sync.hget(keys.key_usage(record.id), "probe")
            cpu = sync.hget(keys.key_cpu(record.id), "probe")
        return float(wall or 0.0), float(cpu or 0.0)

    wall, cpu = charged_now()
    for _ in range(40):  # a runner adds what it charged to Redis once a second
        if cpu >= 0.2:
            break
        await asyncio.sleep(0.1)
        wall, cpu = charged_now()
    assert 0.2 <= cpu <= 0.2 + 5 * 0.015, (cpu, wall)  # its spins, and what else its process did
    assert wall >= 0.4 and cpu < 0.75 * wall, (cpu, wall)  # the sleeps are batch time, not CPU
    listed = await cli("keys", "usage", "--minutes", "5", "--redis", redis_url)
    assert listed.returncode == 0, listed.stderr
    line = next(line for line in listed.stdout.splitlines() if line.startswith(record.id))
    assert line.split()[-2:] == [f"{cpu:.3f}", f"{cpu:.3f}"], listed.stdout  # the window's, and ever
    port = MetricsPort(GatewaySettings(redis_url=redis_url, repo=str(ROOT / "functions")))
    try:
        scraped = (await port.scrape()).decode()
    finally:
        await port.aclose()
    assert f'fngate_key_cpu_seconds_total{{function="probe",key_id="{record.id}"}} {cpu}' in scraped


async def test_a_key_past_its_compute_budget_is_refused_until_the_minute_ends(
    serve_gateway: Callable[..., Any],
    inprocess_runner: Callable[..., Any],
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A key allowed 30 ms of batch time a minute, on a function whose batches take 50 ms: its first
    call is answered and puts it past the budget; at most one more batch of its runs before its
    calls get 429 with a Retry-After to the minute's end, while another key is served."""
    monkeypatch.setenv("PROBE_SLEEP_S", "0.05")
    if time.time() % 60 > 50:  # its calls in one minute: a budget is a minute's
        await asyncio.sleep(61 - time.time() % 60)
    base = await serve_gateway(auth=True, auth_refresh_s=0.2)
    await inprocess_runner()
    key, _ = create_key(redis_url, "invoke:probe", compute_s_per_min=0.03)
    other, _ = create_key(redis_url, "invoke:probe")
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        await warm_up(client, base, "probe", PROBE, other)
        statuses = []
        for _ in range(3):
            answer = await client.post("/v1/functions/probe", json=PROBE, headers=bearer(key))
            statuses.append(answer.status_code)
            if answer.status_code == 429:
                break
        assert statuses[0] == 200 and statuses[-1] == 429, statuses
        assert "compute budget of 0.03 s" in answer.json()["error"]
        assert 1 <= int(answer.headers["retry-after"]) <= 61
        served = await client.post("/v1/functions/probe", json=PROBE, headers=bearer(other))
        assert served.status_code == 200, served.text

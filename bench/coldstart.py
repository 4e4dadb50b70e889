"""Scenario S4 with a large model (`--large-model`): both cold starts of a 268 MB ONNX model served
from S3 (moto's server on loopback) by `fngate up` (runners started on demand, then with a standby
runner), under the manifest's default limits, each against a limit measured in the same run: an
empty artifact cache against the plain boto3 download plus 0.4 s, the artifact on disk against
onnxruntime's own load plus 0.25 s."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.large_model import WIDTH, build

Row = dict[str, Any]
EMPTY_CACHE_MARGIN_S = 0.4
ON_DISK_MARGIN_S = 0.25
STANDBY_START_S = 5.0
"""With the standby runner, the wait before each cold start: the scaler starts the next standby once
no runner starts or loads a model, and it needs its imports done to save them."""
BODY = {"inputs": {"input": [[0.0] * WIDTH]}}
AWS = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def large_cold_starts(
    redis_url: str,
    folder: Path,
    attempts: int,
    record: Callable[[Row], None],
    phases: Callable[[str, float], dict[str, float]],
    wait_for_no_runner: Callable[[str], None],
    wait_live: Callable[..., None],
) -> None:
    print("S4 cold start of a large model (268 MB) from S3: empty cache, then on disk", flush=True)
    function = folder / "large"
    function.mkdir(parents=True)
    build(function / "model.onnx")
    manifest = {
        "name": "large",
        "model": {"backend": "onnxruntime", "path": "model.onnx"},
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, WIDTH]}],
        "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, WIDTH]}],
        "scaling": {"pool": "large", "idle_unload_s": 1},
    }
    (function / "function.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    with moto_server(wait_live) as endpoint:
        env = {**os.environ, **AWS, "AWS_ENDPOINT_URL_S3": endpoint}
        import boto3  # type: ignore[import-untyped]

        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id=AWS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=AWS["AWS_SECRET_ACCESS_KEY"],
        )
        client.create_bucket(Bucket="bench")
        repo = "s3://bench/prod"
        deploy = [
            sys.executable,
            "-m",
            "fngate.cli.main",
            "deploy",
            str(function / "function.yaml"),
            "--repo",
            repo,
            "--redis",
            redis_url,
        ]
        subprocess.run(deploy, env=env, check=True, stdout=subprocess.DEVNULL)
        download_s, load_s = baselines(client, folder / "baseline.onnx")
        limits = {"empty": download_s + EMPTY_CACHE_MARGIN_S, "on disk": load_s + ON_DISK_MARGIN_S}
        bases = {"empty": download_s, "on disk": load_s}
        for runner in ("started on demand", "standby"):
            up_env = {**env, "FNGATE_ARTIFACT_DIR": str(folder / "artifacts")}
            with (
                fngate_up(redis_url, repo, runner == "standby", up_env, folder / "logs", wait_live) as (
                    url,
                    log,
                ),
                httpx.Client(timeout=180) as http,  # made before the clock starts: about 50 ms
            ):
                for attempt in range(attempts):
                    for cache in ("empty", "on disk"):
                        wait_for_no_runner(redis_url)
                        if cache == "empty":
                            shutil.rmtree(folder / "artifacts", ignore_errors=True)
                        if runner == "standby":
                            time.sleep(STANDBY_START_S)  # the standby replaced since the last start
                        offset = log.stat().st_size
                        sent = time.time()
                        response = http.post(f"{url}/v1/functions/large", json=BODY)
                        answered = time.time()
                        record(
                            {
                                "scenario": "S4",
                                "function": "large",
                                "runner": runner,
                                "cache": cache,
                                "attempt": attempt,
                                "status": response.status_code,
                                "spawn_to_answer_ms": (answered - sent) * 1e3,
                                "limit_ms": limits[cache] * 1e3,
                                "baseline_ms": bases[cache] * 1e3,
                                **phases(log.read_bytes()[offset:].decode(errors="replace"), sent),
                            }
                        )


@contextlib.contextmanager
def fngate_up(
    redis_url: str | None,
    repo: str,
    standby: bool,
    env: dict[str, str],
    logs: Path,
    wait_live: Callable[..., None],
    name: str = "large",
    extra: Sequence[str] = (),
) -> Iterator[tuple[str, Path]]:
    """`fngate up` on this Redis (None: its own private one) and repository, with `extra`
    arguments last (they win); yields its URL and its log."""
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"fngate-up-{name}{'-standby' if standby else ''}.log"
    port = free_port()
    command = [sys.executable, "-m", "fngate.cli.main", "up", "--repo", repo]
    command += ["--redis", redis_url] if redis_url is not None else []
    command += ["--port", str(port), "--grpc-port", "0", "--metrics-port", "0"]
    command += ["--idle-shutdown-s", "1"]
    command += ["--log-level", "INFO", "--no-auth"]
    command += ["--standby-runner"] if standby else ["--no-standby-runner"]
    command += list(extra)
    with open(log, "wb") as output:
        up = subprocess.Popen(command, env=env, stdout=output, stderr=output)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_live(url, timeout_s=60)
        yield url, log
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=60)


LOAD_ALONE = """
import sys, time
import onnxruntime as ort
started = time.perf_counter()
ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
print(time.perf_counter() - started)
"""
"""onnxruntime's load of the model as the first in its process, as a runner's is (onnxruntime
imported before the clock starts). A second load in the same process reuses the heap that the
first one faulted in, which no cold start can: here it was 0.1 to 0.35 s faster."""


def baselines(client: Any, path: Path) -> tuple[float, float]:
    """The limits' bases, alone: boto3's download_file of the model, and onnxruntime's session of
    it (the median of three, each in a fresh process)."""
    started = time.perf_counter()
    client.download_file("bench", "prod/large/1/model.onnx", str(path))
    download_s = time.perf_counter() - started
    loads = [
        float(
            subprocess.run(
                [sys.executable, "-c", LOAD_ALONE, str(path)], check=True, capture_output=True
            ).stdout
        )
        for _ in range(3)  # one load alone swings by a tenth of a second or more here
    ]
    load_s = statistics.median(loads)
    path.unlink()
    print(
        f"  baselines: boto3 download {download_s:.3f} s, onnxruntime load {load_s:.3f} s "
        f"(fresh processes: {', '.join(f'{s:.3f}' for s in loads)})",
        flush=True,
    )
    return download_s, load_s


@contextlib.contextmanager
def moto_server(wait_live: Callable[..., None]) -> Iterator[str]:
    """moto's S3 server in a process of its own on loopback; yields its endpoint URL."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_live(endpoint, timeout_s=60, path="/moto-api/")
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=30)


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port: int = sock.getsockname()[1]
    return port
